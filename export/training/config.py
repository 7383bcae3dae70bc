"""The options of a drafter training run: one definition for the trainer and its command line.

Contract: `TrainConfig` is the run's configuration (`train.train(cfg)`). Every field that
`ovdflash train` takes carries its command-line form in the field's metadata (`cli_option`: flag,
help, and how the value is read), so the command line is generated from this class
(`ovdflash.cli.train`) and never written out a second time. `CLI_OPTIONS` lists (field name,
`CliOption`) in the order `--help` shows them. This module imports neither torch nor click: the
runtime package reads it without the export extra.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields


@dataclass(frozen=True)
class CliOption:
    """How a TrainConfig field appears on the command line.

    `kind`: None (click infers the type from the default), "int" / "float" (a value that may be
    absent), "ids" (a comma list of ints), "dir" (a directory path), "existing_dir" (one that must
    exist), "negated_flag" (the flag turns the boolean field off), "choice" (one of `choices`).
    `minimum` / `maximum` bound an int or float value. `multiple`: repeatable, read as a list."""

    flag: str
    help: str | None = None
    kind: str | None = None
    required: bool = False
    multiple: bool = False
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()


def option(flag: str, default=MISSING, help: str | None = None, *, default_factory=MISSING, **how):
    """A dataclass field whose command-line form is `flag` (see CliOption for `how`)."""
    meta = {"cli_option": CliOption(flag, help, **how)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    target: str = option("--target", required=True,
                         help="HF model directory of the target, or 'default' (the embedded default's target, fetched into the ovdflash cache).")
    data_dirs: list[str] = option(
        "--data", multiple=True, required=True,
        help="Data directory written by `python -m ovdflash_export.training.data` (repeatable).")
    out_dir: str = option("--out", kind="dir", required=True,
                          help="Checkpoint directory (config.json + model.safetensors + train_state.pt).")
    eval_dirs: list[str] = option("--eval-data", default_factory=list, multiple=True,
                                  help="Held-out data directory: tau estimate per domain.")
    # train_state.pt is ~12x the checkpoint
    state_dir: str | None = option("--state-dir", None, kind="dir",
                                   help="Where train_state.pt (optimizer etc., for resuming) goes; default: --out.")
    num_layers: int = option("--layers", 1, "Drafter decoder layers.")
    block_size: int = option("--block-size", 8)
    target_layer_ids: list[int] | None = option(
        "--target-layer-ids", None, "Comma list, e.g. 1,8,14,20,27 (default: z-lab formula).", kind="ids")
    num_features: int = option("--num-features", 5, "Feature layers when ids are not given.")
    mask_token_id: int | None = option("--mask-token-id", None, "Default: the last embedding row.", kind="int")
    anchors_per_seq: int = option("--anchors", 48, "Anchors (blocks) per sequence per step.")
    batch_seqs: int = option("--batch", 8, "Sequences per step.")
    max_len: int = option("--max-len", 768)
    lr: float = option("--lr", 6e-4)
    min_lr_ratio: float = 0.1
    warmup_steps: int = option("--warmup", 48)
    # the schedule's length: in steps, or in wall-clock minutes (then steps are open-ended)
    max_steps: int | None = option("--steps", None, "Schedule length in steps.", kind="int")
    minutes: float | None = option("--minutes", None, "Schedule length in wall-clock minutes.", kind="float")
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = option("--gamma", 4.0, "Slot weight decay exp(-(k-1)/gamma).")
    vocab_subset: bool = option("--no-vocab-subset", True, "Full-vocabulary CE (slow on CPU).", kind="negated_flag")
    num_negatives: int = option("--negatives", 1024)
    feature_scaling: bool = option("--no-feature-scaling", True, kind="negated_flag")
    # final norm scale at init; None: 1 / median target embedding norm, so initial logits are O(1)
    # (at 1.0 SmolLM2 starts at logits of +-60, a loss that takes ~100 steps to leave)
    final_norm_init: float | None = None
    val_fraction: float = 0.05
    val_every: int = option("--val-every", 100)
    max_val_seqs: int = 48
    # the rest of the batch re-reads cached features of earlier sequences: on a CPU the frozen
    # target's forward costs several drafter steps, so this makes data reuse cheap
    new_per_step: int | None = option(
        "--new-per-step", None, kind="int",
        help="Sequences with fresh target features per step; the rest reuse cached ones (CPU speed-up).")
    reload_every: int = option(
        "--reload-every", 0,
        "Steps between re-reading --data (0: never); lets training run while data is still generated.")
    val_anchors: int = 16
    save_every_s: float = option("--save-every", 180.0, "Seconds between checkpoints.")
    feature_cache_gb: float = option("--feature-cache-gb", 4.0)
    seed: int = option("--seed", 0)
    # kept apart from `seed` so that a continuation with another seed validates on the same
    # prompts: a warm start that validated on others would score sequences its parent trained on
    val_seed: int | None = option(
        "--val-seed", None, kind="int",
        help="Seed of the validation split (held-back prompts); default: the one --init-from recorded, else --seed.")
    stop_after_steps: int | None = None  # end this invocation early (schedule unchanged), as a kill would
    # labels = the target's own greedy chain (batch.build_batch); needed for teacher-forced text data
    relabel: bool = option("--no-relabel", True, kind="negated_flag",
                           help="Train on the stored tokens instead of the target's greedy chain (see "
                                "batch.py; teacher-forced text data needs relabelling).")
    features_root: str | None = option(
        "--features", None, kind="existing_dir",
        help="Precomputed OpenVINO target features (python -m ovdflash_export.training.features): one "
             "sub-directory per data directory's name; those sequences never run the torch target.")
    kd_weight: float = option(
        "--kd-weight", 0.0, minimum=0.0, maximum=1.0,
        help="Weight of distillation on the target's top-k distributions (those stored with --features computed "
             "with --topk, else computed by the torch target: --kd-topk); 0 trains on greedy labels only.")
    kd_topk: int = option("--kd-topk", 32, minimum=1,
                          help="Without stored top-k: how many of the target's most likely next tokens the "
                               "distillation sees.")
    # a drafter that only ever saw full blocks drafts the first slots of a shorter block worse
    short_blocks: float = option(
        "--short-blocks", 0.0, minimum=0.0, maximum=1.0,
        help="Fraction of training blocks cut to a random length 2..block-1, so the drafter also drafts "
             "well when the runtime verifies fewer drafts than the block holds.")
    # the CE still trains over the whole subset; a smaller head makes every draft call cheaper
    draft_vocab_size: int | None = option(
        "--draft-vocab-size", None, minimum=1,
        help="Write a draft vocabulary of the N ids the target's responses use most (default: every id "
             "the CE trained over); the drafter's head at run time has these rows only.")
    # recomputed when the data grows; the head GEMM, a large share of a step, shrinks with it
    ce_vocab_size: int | None = option(
        "--ce-vocab-size", None, minimum=1,
        help="Score only the N ids the target's responses use most (no negatives): the CE and "
             "distillation train exactly the head the runtime applies, which is written as the draft "
             "vocabulary; a smaller head also makes each step cheaper.")
    init_from: str | None = option(
        "--init-from", None, kind="existing_dir",
        help="Warm start from this drafter checkpoint (same geometry, or fewer layers: added layers start as "
             "no-ops); a fresh optimizer and schedule.")
    device: str = option("--device", "auto")
    threads: int | None = option("--threads", None, kind="int")
    # weights, optimizer and evaluation stay f32 under bf16
    autocast: str = option("--autocast", "none", kind="choice", choices=("none", "bf16"),
                           help="Mixed precision for the drafter's training passes (bf16: ~1.3x a step "
                                "measured on an AMX CPU).")
    target_batch: int = option(
        "--target-batch", 0, minimum=0,
        help="Sequences per torch-target forward for features not precomputed (0: 32 on CUDA, 1 on a CPU).")
    extra: dict = field(default_factory=dict)


CLI_OPTIONS: list[tuple[str, CliOption]] = [
    (f.name, f.metadata["cli_option"]) for f in fields(TrainConfig) if "cli_option" in f.metadata]


def parse_ids(text: str | None) -> list[int] | None:
    """A comma list of ints ("1,8,14") as a list; None or "" as None."""
    return [int(x) for x in text.split(",")] if text else None
