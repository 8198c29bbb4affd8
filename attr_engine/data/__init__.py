"""Datasets: procedural shapes with ground-truth masks, and users' image folders."""

from attr_engine.data.folder import IMAGE_EXTENSIONS, ImageFolderDataset
from attr_engine.data.shapes import SHAPE_KINDS, ShapesDataset, ShapesSample

__all__ = ["IMAGE_EXTENSIONS", "SHAPE_KINDS", "ImageFolderDataset", "ShapesDataset", "ShapesSample"]
