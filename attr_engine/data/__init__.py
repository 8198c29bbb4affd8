"""Datasets: procedural shapes with ground-truth masks, crops of real photographs, and users' image folders."""

from attr_engine.data.folder import IMAGE_EXTENSIONS, ImageFolderDataset
from attr_engine.data.photos import PHOTO_CLASSES, PhotoCropsDataset
from attr_engine.data.shapes import SHAPE_KINDS, ShapesDataset, ShapesSample

__all__ = [
    "IMAGE_EXTENSIONS",
    "PHOTO_CLASSES",
    "SHAPE_KINDS",
    "ImageFolderDataset",
    "PhotoCropsDataset",
    "ShapesDataset",
    "ShapesSample",
]
