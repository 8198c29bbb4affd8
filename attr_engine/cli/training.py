"""``train-classifier`` and ``train-aha``: the two trainings, on embedded data or an image folder."""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

from attr_engine.cli._common import (
    EMBEDDED,
    HELD_OUT_SEED,
    SMALL_MODELS,
    UsageError,
    add_classifier_args,
    add_device_arg,
    check_classifier_args,
    check_model_flags,
    check_ray_pool,
    check_writable_dir,
    classifier_args,
    parse_key_values,
    ray_actor_gpus,
    resolve_device,
    warn_if_untrained,
    work_started,
)
from attr_engine.guards import (
    CLASSIFIER_FILE,
    check_checkpoint_file,
    check_count,
    check_data_dir,
    check_model_name_path,
)

# train-aha's teacher weight when --teacher is given and neither the config nor --teacher-weight sets one.
DEFAULT_TEACHER_WEIGHT = 1.0


def register(subparsers: Any) -> dict[str, argparse.ArgumentParser]:
    tc = subparsers.add_parser(
        "train-classifier",
        help="train a classifier (a small timm preset or any timm model) on embedded data or an image folder",
        description="Train a classifier and write OUT/classifier.safetensors (weights plus what is needed to rebuild "
        "it) and OUT/train.json. Start from scratch, from timm's pretrained weights (--pretrained), or fine-tune a "
        "checkpoint (--init).",
    )
    tc.add_argument(
        "--model",
        default="small-resnet",
        help="timm model name, or a preset that trains on a CPU in minutes: small-resnet (default), small-vit",
    )
    tc.add_argument("--pretrained", action="store_true", help="start from timm's pretrained weights (download)")
    tc.add_argument("--init", metavar="PATH", help="fine-tune this classifier checkpoint instead of a fresh model")
    _add_data_args(tc, default_images=2000)
    tc.add_argument("--out", required=True, help="output directory")
    tc.add_argument("--epochs", type=int, default=6, help="passes over the data (default 6)")
    tc.add_argument("--batch-size", type=int, default=32, help="images per step (default 32)")
    tc.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default 0.001)")
    tc.add_argument("--seed", type=int, default=0, help="seed of the data, initialisation and order (default 0)")
    tc.add_argument("--workers", type=int, default=0, help="data-loading worker processes (default 0: in this process)")
    tc.add_argument("--resume", action="store_true", help="keep a classifier OUT already holds instead of failing")
    tc.add_argument("--overwrite", action="store_true", help="replace a classifier OUT already holds")
    tc.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_device_arg(tc)
    tc.set_defaults(run=run_train_classifier)

    ta = subparsers.add_parser(
        "train-aha",
        help="train the AHA explainer for a classifier (DDP under torchrun)",
        description="Train AHA's decoder for a frozen classifier and write its checkpoint directory OUT "
        "(explainer.safetensors, config.json, trainer.safetensors). Checkpoints are written every "
        "--checkpoint-every steps; --resume continues an interrupted run exactly where it stopped. Under "
        "'torchrun --nproc_per_node=N -m attr_engine train-aha ...' the decoder trains with DDP (--batch-size "
        "is per process). AHAConfig fields can be set in the config file's 'aha:' section or with --aha-option. "
        "--val-fraction holds out part of the data: training is scored on it every --val-every steps, stops after "
        "--patience scores without improvement and keeps the best decoder (OUT/val_curve.png, OUT/train.json).",
    )
    add_classifier_args(ta)
    _add_data_args(ta, default_images=2000)
    ta.add_argument("--out", required=True, help="AHA checkpoint directory")
    ta.add_argument("--epochs", type=int, default=None, help="passes over the data (default 1; with --val-fraction "
                    "the cap, default 10)")  # fmt: skip
    ta.add_argument("--batch-size", type=int, default=32, help="images per step and process (default 32)")
    ta.add_argument("--max-steps", type=int, help="stop after this many optimiser steps")
    ta.add_argument("--val-fraction", type=float, default=None, metavar="F",
                    help="hold out this fraction of the data (a split by --seed and file name) for validation and "
                    "early stopping")  # fmt: skip
    ta.add_argument("--val-every", type=int, default=None, help="steps between validation scores (AHAConfig."
                    "val_every, default 50)")  # fmt: skip
    ta.add_argument("--patience", type=int, default=None, help="validation scores without improvement before "
                    "training stops (AHAConfig.patience, default 5)")  # fmt: skip
    ta.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default 50)")
    ta.add_argument("--resume", action="store_true", help="continue from the checkpoint in OUT")
    ta.add_argument("--overwrite", action="store_true", help="start over even if OUT holds a checkpoint")
    ta.add_argument("--seed", type=int, default=None, help="training seed (AHAConfig.seed, default 42)")
    ta.add_argument("--lr", type=float, default=None, help="AdamW learning rate (AHAConfig.lr, default 3e-4)")
    ta.add_argument("--n-fractions", type=int, default=None, help="perturbation fractions per curve (default 16)")
    ta.add_argument("--targets", choices=("pred+label", "pred"), default=None, help="classes explained per image")
    ta.add_argument("--aha-option", action="append", metavar="KEY=VALUE", help="any AHAConfig field, repeatable")
    ta.add_argument("--workers", type=int, default=0, help="data-loading worker processes (default 0: in this process)")
    ta.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_teacher_args(ta)
    add_device_arg(ta)
    ta.set_defaults(run=run_train_aha, _config_sections=("aha",))
    return {"train-classifier": tc, "train-aha": ta}


def _add_teacher_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "teacher",
        "The decoder also learns to rank each training image's regions like that image's per-image optimum (AHA's "
        "objective optimised on the image alone, the maps AHA.optimise_maps gives). The optimum is computed once per "
        "training image and stored in the --teacher folder; under torchrun each process computes its share, with "
        "--teacher-engine ray a Ray Data actor pool computes them before training starts here.",
    )
    group.add_argument("--teacher", metavar="DIR", help="the teacher maps' folder: parts missing there are computed "
                       "first (a killed run keeps the finished ones), then training learns from them")  # fmt: skip
    group.add_argument("--teacher-weight", type=float, default=None, metavar="W",
                       help="weight of the teacher's loss beside the soft AUCs (AHAConfig.teacher_weight; "
                       "default 1.0 with --teacher)")  # fmt: skip
    group.add_argument("--teacher-loss", choices=("ranking", "pixel"), default=None,
                       help="what the teacher's loss compares (AHAConfig.teacher_loss): ranking (the ranking of the "
                       "region scores, the default) or pixel (the z-scored maps pixel by pixel)")  # fmt: skip
    group.add_argument("--teacher-steps", type=int, default=30, help="optimum steps per image (default 30)")
    group.add_argument("--teacher-lr", type=float, default=0.05, help="the optimum's Adam step size (default 0.05)")
    group.add_argument("--teacher-engine", choices=("local", "ray"), default="local",
                       help="local (default: this process, or each torchrun process its share) or ray (an actor pool "
                       "on a Ray cluster; --teacher must be a folder every node writes to; pip install "
                       "'attr-engine[ray]')")  # fmt: skip
    group.add_argument("--teacher-actors", type=int, default=None, metavar="N",
                       help="with --teacher-engine ray: actors in the pool (default 1)")  # fmt: skip
    group.add_argument("--teacher-gpus-per-actor", type=float, default=None, metavar="G",
                       help="with --teacher-engine ray: GPUs each actor reserves (default: 1 when the cluster has "
                       "GPUs and --device is not cpu, else 0)")  # fmt: skip
    group.add_argument("--address", metavar="ADDR",
                       help="with --teacher-engine ray: the Ray cluster to join (ray://head:10001, auto); default: "
                       "$RAY_ADDRESS, else a local cluster on this machine")  # fmt: skip


def _add_data_args(parser: argparse.ArgumentParser, *, default_images: int) -> None:
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data",
        default=EMBEDDED,
        help=f"'{EMBEDDED}' (the embedded procedural dataset, generated on the fly) or an ImageFolder directory "
        "(one subfolder per class)",
    )
    group.add_argument(
        "--num-images",
        type=int,
        default=default_images,
        help=f"images generated for --data {EMBEDDED} (default {default_images})",
    )
    group.add_argument(
        "--img-size",
        type=int,
        default=None,
        help="square input side (default: the classifier's; 64 for the presets and the embedded data, else 224)",
    )


def load_training_data(data: str, *, img_size: int, num_images: int, seed: int) -> Any:
    """The embedded shapes (seeded) or an image folder resized to ``img_size``; unreadable images are skipped."""
    from attr_engine.data import ImageFolderDataset, ShapesDataset

    if data == EMBEDDED:
        if num_images < 1:
            raise UsageError(f"--num-images must be >= 1, got {num_images}")
        return ShapesDataset(num_images, img_size=img_size, seed=seed, with_masks=False)
    root = check_data_dir(data, embedded=EMBEDDED)
    assert root is not None  # data is not the embedded set's name
    ds = ImageFolderDataset(root, img_size=img_size, skip_unreadable=True)
    if not ds.class_names:
        raise UsageError(f"{root} has no class subfolders; training needs the ImageFolder layout root/<class>/<image>")
    return ds


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{flag} must be >= 1, got {value}")


def _check_classifier_training(args: argparse.Namespace) -> None:
    """train-classifier's flags and paths that need no model, checked before torch is imported."""
    check_count(args.epochs, "epochs", flag="--epochs")
    check_count(args.batch_size, "batch_size", flag="--batch-size")
    _positive(args.num_images, "--num-images")
    check_model_flags(None, args.img_size)  # before any image is resized to it
    if args.model in SMALL_MODELS:
        if args.pretrained or args.init:
            raise UsageError(f"{args.model} is trained from scratch; --pretrained / --init need a timm model name")
    else:
        check_model_name_path(args.model, cli=True, checkpoint_flag="--init")
    if args.init:
        check_checkpoint_file(args.init, cli=True, flag="--init")
        if args.pretrained:
            raise UsageError("--init and --pretrained exclude each other")
    check_data_dir(args.data, embedded=EMBEDDED)


def run_train_classifier(args: argparse.Namespace) -> int:
    _check_classifier_training(args)
    from tqdm.auto import tqdm

    from attr_engine.checkpoint import save_json
    from attr_engine.classifier import save_classifier
    from attr_engine.classifier_training import evaluate_accuracy, train_classifier

    device = resolve_device(args.device)
    out = check_writable_dir(args.out)
    target = out / CLASSIFIER_FILE
    if target.exists():
        if args.resume and not args.overwrite:
            print(f"{target} already holds a trained classifier; nothing to do (--overwrite retrains)")
            return 0
        if not args.overwrite:
            raise UsageError(f"{target} exists; pass --overwrite to retrain or --resume to keep it")

    small = args.model in SMALL_MODELS or args.data == EMBEDDED
    img_size = args.img_size or (64 if small else 224)
    train_set = load_training_data(args.data, img_size=img_size, num_images=args.num_images, seed=args.seed)
    num_classes = len(train_set.class_names)
    eval_set = None
    if args.data == EMBEDDED:
        from attr_engine.data import ShapesDataset

        # A held-out set from another seed: the accuracy in train.json is measured on images never trained on.
        eval_set = ShapesDataset(256, img_size=img_size, seed=args.seed + HELD_OUT_SEED, with_masks=False)

    model = _initial_model(args, img_size, num_classes)
    work_started()
    log: list[dict[str, float]] = []
    start = time.perf_counter()
    with tqdm(total=args.epochs, desc="classifier", unit="epoch", disable=args.no_progress, dynamic_ncols=True) as bar:

        def on_epoch(stats: dict[str, float]) -> None:
            log.append(stats)
            bar.update(1)
            bar.set_postfix({k: f"{v:.3f}" for k, v in stats.items() if k in ("loss", "train_acc", "eval_acc")})

        clf = train_classifier(
            model,
            train_set,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            device=device,
            num_classes=num_classes,
            num_workers=args.workers,
            eval_dataset=eval_set,
            log=on_epoch,
        )
    seconds = time.perf_counter() - start
    save_classifier(clf, target)
    summary: dict[str, Any] = {
        "model": clf.model_name,
        "model_kwargs": clf.model_kwargs,
        "classes": list(train_set.class_names),
        "data": args.data,
        "num_images": len(train_set),
        "img_size": img_size,
        "epochs": args.epochs,
        "seed": args.seed,
        "seconds": round(seconds, 2),
        "log": log,
    }
    if eval_set is not None:
        summary["eval_accuracy"] = evaluate_accuracy(clf, eval_set)
    save_json(summary, out / "train.json")
    acc = f", held-out accuracy {summary['eval_accuracy']:.1%}" if "eval_accuracy" in summary else ""
    print(f"classifier {clf.model_name} trained in {seconds:.0f} s{acc}: {target}")
    return 0


def _initial_model(args: argparse.Namespace, img_size: int, num_classes: int) -> Any:
    """What training starts from: a preset's config, a checkpoint to fine-tune, pretrained timm weights, or a timm
    model name (built when training starts)."""
    from attr_engine.classifier import load_classifier
    from attr_engine.classifier_training import small_model_config

    if args.model in SMALL_MODELS:  # the flags were checked with the others (_check_classifier_training)
        return small_model_config(SMALL_MODELS[args.model], img_size)
    elif args.init:
        model = load_classifier(args.model, checkpoint=args.init, img_size=img_size)
        if model.num_classes != num_classes:
            raise UsageError(
                f"{args.init} has {model.num_classes} classes but the data has {num_classes}; fine-tuning keeps them"
            )
        return model
    elif args.pretrained:
        # timm replaces the pretrained head by a fresh one when num_classes differs from the checkpoint's.
        return load_classifier(args.model, pretrained=True, num_classes=num_classes, img_size=img_size)
    else:
        from attr_engine.classifier import check_model_name

        try:
            check_model_name(args.model)  # the name is built into a model only once training starts
        except ValueError as err:
            raise UsageError(str(err)) from None
        return args.model


def aha_config_from_args(args: argparse.Namespace) -> Any:
    """AHAConfig from the config file's ``aha:`` section, then ``--aha-option``, then the dedicated flags."""
    from attr_engine.aha import AHAConfig

    fields: dict[str, Any] = dict(getattr(args, "aha_section", None) or {})
    fields.update(parse_key_values(args.aha_option, "--aha-option"))
    for flag in ("seed", "lr", "n_fractions", "targets", "val_every", "patience", "teacher_weight", "teacher_loss"):
        if getattr(args, flag, None) is not None:
            fields[flag] = getattr(args, flag)
    if getattr(args, "teacher", None) and "teacher_weight" not in fields:
        fields["teacher_weight"] = DEFAULT_TEACHER_WEIGHT
    if fields.get("teacher_loss", "ranking") != "ranking" and not getattr(args, "teacher", None):
        # From --aha-option or a config file: without a teacher there is no teacher loss, so it would do nothing.
        raise UsageError(f"teacher_loss={fields['teacher_loss']!r} needs --teacher (the folder of the teacher maps)")
    try:
        return AHAConfig.from_dict(fields)  # JSON / YAML lists become tuples there
    except TypeError as err:
        raise UsageError(f"bad AHA option: {err}") from None


def _check_aha_training(args: argparse.Namespace) -> None:
    """train-aha's flags and paths that need no model, checked before torch is imported: the counts with the
    bounds AHAConfig and the trainer check (:data:`attr_engine.guards.COUNT_MINIMUM`)."""
    for option in ("epochs", "batch_size", "max_steps", "checkpoint_every", "val_every", "patience", "n_fractions"):
        if getattr(args, option) is not None:
            check_count(getattr(args, option), option, flag="--" + option.replace("_", "-"))
    _positive(args.num_images, "--num-images")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:  # NaN too: checked before any loading
        raise UsageError(f"--val-fraction: the validation fraction must be in (0, 1), got {args.val_fraction}")
    check_data_dir(args.data, embedded=EMBEDDED)
    check_classifier_args(args)
    _check_teacher_args(args)


def _check_teacher_args(args: argparse.Namespace) -> None:
    ray_flags = {"--teacher-actors": args.teacher_actors, "--teacher-gpus-per-actor": args.teacher_gpus_per_actor,
                 "--address": args.address}  # fmt: skip
    if args.teacher is None:
        teacher_flags = {"--teacher-weight": args.teacher_weight, "--teacher-loss": args.teacher_loss}
        given = [f for f, value in {**teacher_flags, **ray_flags}.items() if value is not None]
        if given or args.teacher_engine != "local":
            raise UsageError(f"{(given or ['--teacher-engine'])[0]} needs --teacher (the folder of the teacher maps)")
        return
    if args.teacher_engine != "ray":
        given = [flag for flag, value in ray_flags.items() if value is not None]
        if given:
            raise UsageError(f"{given[0]} applies to --teacher-engine ray only")
    else:
        args.teacher_actors = check_ray_pool("--teacher-engine ray", args.teacher_actors, args.teacher_gpus_per_actor,
                                             flags=("--teacher-actors", "--teacher-gpus-per-actor"))  # fmt: skip
        if os.environ.get("WORLD_SIZE", "1") != "1":
            raise UsageError("--teacher-engine ray computes the teacher for every process: run it without torchrun")
    check_count(args.teacher_steps, "teacher_steps", flag="--teacher-steps")
    if not math.isfinite(args.teacher_lr) or args.teacher_lr <= 0:
        raise UsageError(f"--teacher-lr must be a finite number > 0, got {args.teacher_lr}")
    if args.teacher_weight is not None and not (math.isfinite(args.teacher_weight) and args.teacher_weight > 0):
        raise UsageError(f"--teacher-weight must be a finite number > 0 with --teacher, got {args.teacher_weight}")
    check_writable_dir(args.teacher)


def run_train_aha(args: argparse.Namespace) -> int:
    _check_aha_training(args)
    from attr_engine.aha import AHA
    from attr_engine.aha.persistence import CHECKPOINTS_DIR, CONFIG_FILE, has_checkpoint
    from attr_engine.classifier import load_classifier
    from attr_engine.distributed import process_rank

    rank, world = process_rank()
    device = resolve_device(args.device)
    config = aha_config_from_args(args)
    out = check_writable_dir(args.out)
    resumable = has_checkpoint(out)
    holds = resumable or (out / CONFIG_FILE).exists() or (out / CHECKPOINTS_DIR).exists()
    if holds and not (args.resume or args.overwrite):
        raise UsageError(f"{out} already holds an AHA checkpoint; pass --resume to continue or --overwrite")
    # Resuming takes the newest complete checkpoint in OUT (a torn newer one, from a kill, is passed over).
    resume = out if args.resume and resumable and not args.overwrite else None
    if args.resume and resume is None and rank == 0:
        print(f"no checkpoint to resume in {out}; starting from scratch")

    classifier = load_classifier(**classifier_args(args, img_size=args.img_size)).to(device)
    warn_if_untrained(args)
    img_size = args.img_size or (classifier.input_size[1] if classifier.input_size else 224)
    data = load_training_data(args.data, img_size=img_size, num_images=args.num_images, seed=config.seed)
    if classifier.num_classes < len(getattr(data, "class_names", ())):
        raise UsageError(
            f"the data has {len(data.class_names)} classes but the classifier only {classifier.num_classes}"
        )
    train, val = split_validation(data, args.val_fraction, seed=config.seed)
    if len(train) // world < args.batch_size:
        raise UsageError(f"--batch-size {args.batch_size} is more than the {len(train) // world} images per process")
    aha = AHA(classifier, config, img_size=img_size)
    work_started()
    teacher, teacher_seconds = None, 0.0
    if args.teacher:
        start = time.perf_counter()
        teacher = teacher_maps(args, aha, train, rank=rank, world=world)
        teacher_seconds = time.perf_counter() - start
    start = time.perf_counter()
    history = aha.fit(
        train,
        epochs=args.epochs,
        batch_size=args.batch_size,
        max_steps=args.max_steps,
        checkpoint_dir=out,
        checkpoint_every=args.checkpoint_every,
        resume=resume,
        num_workers=args.workers,
        progress=not args.no_progress,
        val=val,
        teacher=teacher,
    )
    if rank == 0:
        seconds = time.perf_counter() - start
        _report_aha(args, aha, history, out, seconds=seconds, world=world, val=val, teacher=teacher,
                    teacher_seconds=teacher_seconds)  # fmt: skip
    return 0


def teacher_maps(args: argparse.Namespace, aha: Any, train: Any, *, rank: int, world: int) -> Any:
    """The :class:`~attr_engine.aha.teacher.TeacherMaps` of the training part ``train``, read from ``--teacher``
    after this process has computed its missing share (under torchrun every process waits for the others)."""
    from attr_engine.aha.teacher import TeacherMaps, compute_teacher_maps
    from attr_engine.distributed import init_process_group

    folder = Path(args.teacher)
    if args.teacher_engine == "ray":
        from attr_engine.ray import compute_teacher_maps_ray, ray_session

        with ray_session(args.address):
            gpus = ray_actor_gpus(args.address, args.teacher_actors, args.teacher_gpus_per_actor, args.device)
            parts = compute_teacher_maps_ray(aha, train, folder, steps=args.teacher_steps, lr=args.teacher_lr,
                                             actors=args.teacher_actors, num_gpus=gpus, device=args.device)  # fmt: skip
        computed = sum(done for _, done in parts)
        print(f"teacher: {computed} of {len(parts)} parts computed on {args.teacher_actors} Ray actor(s)")
    else:
        compute_teacher_maps(aha, train, folder, steps=args.teacher_steps, lr=args.teacher_lr, rank=rank,
                             world=world, progress=not args.no_progress)  # fmt: skip
    if world > 1:
        import torch.distributed as dist

        init_process_group(aha.device)
        dist.barrier()
    try:
        return TeacherMaps.load(folder, len(train))
    except ValueError as err:
        raise UsageError(f"--teacher {folder}: {err}") from None


def split_validation(data: Any, fraction: float | None, *, seed: int) -> tuple[Any, Any]:
    """``(training part, validation part)`` of ``data`` for ``--val-fraction`` (``(data, None)`` without it): a
    seeded split of the items' sorted names (:func:`attr_engine.data.split.holdout_split`)."""
    if fraction is None:
        return data, None
    from torch.utils.data import Subset

    from attr_engine.data.split import holdout_split

    try:
        kept, held_out = holdout_split(data, fraction, seed=seed)
    except ValueError as err:
        raise UsageError(f"--val-fraction: {err}") from None
    return Subset(data, kept), Subset(data, held_out)


def _report_aha(
    args: argparse.Namespace, aha: Any, history: dict[str, list[float]], out: Path, *, seconds: float, world: int,
    val: Any, teacher: Any, teacher_seconds: float,
) -> None:  # fmt: skip
    """Print the run's summary line and write ``OUT/train.json`` (and ``OUT/val_curve.png`` with validation)."""
    from attr_engine.aha.persistence import CONFIG_FILE
    from attr_engine.checkpoint import load_json, save_json

    steps = len(history["loss"])
    tail = max(1, min(10, steps))
    trend = ""
    if steps:
        dele = sum(history["deletion"][-tail:]) / tail
        ins = sum(history["insertion"][-tail:]) / tail
        trend = f"; last steps: soft deletion {dele:.3f}, soft insertion {ins:.3f}"
    world_note = f" on {world} processes" if world > 1 else ""
    if teacher is not None:
        taught = [v for v in history["teacher"][-tail:] if v == v]  # NaN: no image of the step had its class
        kind = aha.config.teacher_loss
        trend += f", teacher loss ({kind}) {sum(taught) / len(taught):.3f}" if taught else ""
        print(f"teacher: the optimum of {len(teacher)} training images in {args.teacher} ({teacher_seconds:.0f} s)")
    print(
        f"AHA: {steps} step(s) this run, {aha.steps_trained} in total{world_note}, "
        f"{seconds:.0f} s{trend}; checkpoint in {out}"
    )
    summary: dict[str, Any] = {"steps_this_run": steps, "steps_trained": aha.steps_trained, "world": world,
                               "seconds": round(seconds, 2), "data": args.data, "seed": aha.config.seed}  # fmt: skip
    if teacher is not None:
        summary.update(teacher=str(args.teacher), teacher_settings=teacher.settings,
                       teacher_seconds=round(teacher_seconds, 2))  # fmt: skip
    if val is not None:
        # The checkpoint's own record of the curve: the whole run's, a resumed one's earlier scores included.
        validation = load_json(out / CONFIG_FILE)["validation"]
        summary.update(val_fraction=args.val_fraction, val_images=len(val), validation=validation)
        _print_validation(validation, out)
    save_json(summary, out / "train.json")


def _print_validation(validation: dict[str, Any], out: Path) -> None:
    from attr_engine.visualize import plot_validation_curve

    curve, best = validation["curve"], validation["best_step"]
    end = "stopped early" if validation["stopped"] else "step budget spent"
    title = f"AHA validation (hard composite): {end} at step {curve[-1]['step']}"
    picture = plot_validation_curve(curve, out / "val_curve.png", best_step=best, title=title)
    stop = (
        f"stopped early after {validation['bad_scores']} score(s) without improvement"
        if validation["stopped"]
        else "ran to its step budget"
    )
    print(
        f"validation: best composite {validation['best_composite']:.3f} at step {best} of {curve[-1]['step']} "
        f"({len(curve)} scores, {stop}; decoder of step {best} kept); curve in {picture}"
    )
