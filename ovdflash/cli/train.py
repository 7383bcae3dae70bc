"""`ovdflash train`: distill a DFlash drafter for a Hugging Face target (needs the export extra).

The command only parses options; the work is `ovdflash_export.training.train.train`, imported when
the command runs so that `ovdflash --help` never loads torch. Its options are generated from the
one definition of the run's configuration, `ovdflash_export.training.config.TrainConfig` (torch-free),
plus the two of `--evaluate-only`. Re-running the same command with the same --out resumes from
`train_state.pt` (model, optimizer, step, schedule position).
"""
import json

import click
from ovdflash_export.training.config import CLI_OPTIONS, CliOption, TrainConfig, parse_ids


def _click_option(name: str, spec: CliOption, default):
    """The click option of TrainConfig field `name` (its value arrives under `name`)."""
    if spec.kind == "negated_flag":  # the flag turns the field off; mapped back in `_config`
        return click.option(spec.flag, name, is_flag=True, help=spec.help)
    kw = {"help": spec.help, "required": spec.required, "multiple": spec.multiple}
    if not spec.required and not spec.multiple:
        kw["default"] = default
        kw["show_default"] = default is not None
    if spec.kind == "int":
        kw["type"] = int
    elif spec.kind == "float":
        kw["type"] = float
    elif spec.kind == "dir":
        kw["type"] = click.Path(file_okay=False)
    elif spec.kind == "existing_dir":
        kw["type"] = click.Path(exists=True, file_okay=False)
    elif spec.kind == "choice":
        kw["type"] = click.Choice(list(spec.choices))
    elif spec.minimum is not None or spec.maximum is not None:
        as_float = isinstance(default, float)
        kw["type"] = (click.FloatRange if as_float else click.IntRange)(spec.minimum, spec.maximum)
    return click.option(spec.flag, name, **kw)


def _config_options(command):
    defaults = {f: TrainConfig.__dataclass_fields__[f].default for f, _ in CLI_OPTIONS}
    for name, spec in reversed(CLI_OPTIONS):  # click shows the options in decoration order, bottom up
        command = _click_option(name, spec, defaults[name])(command)
    return command


def _config(values: dict) -> TrainConfig:
    """The TrainConfig of the parsed config options (`values`: field name -> click's value)."""
    kinds = dict((name, spec.kind) for name, spec in CLI_OPTIONS)
    cfg = {}
    for name, value in values.items():
        if kinds[name] == "negated_flag":
            value = not value
        elif kinds[name] == "ids":
            value = parse_ids(value)
        elif isinstance(value, tuple):
            value = list(value)
        cfg[name] = value
    return TrainConfig(**cfg)


@click.command(name="train")
@_config_options
@click.option("--eval-block-len", type=click.IntRange(min=2), default=None,
              help="With --evaluate-only: estimate acceptance for blocks of this many tokens (default: the full block).")
@click.option("--evaluate-only", is_flag=True, help="Only print the tau estimate of the checkpoint in --out on --eval-data.")
def train(eval_block_len, evaluate_only, **options):
    """Distill a DFlash drafter for a target model."""
    try:
        from ovdflash_export.training.evaluate import evaluate_checkpoint
        from ovdflash_export.training.train import train as run_training
    except ImportError as exc:
        raise click.ClickException(f"training needs the export extra (torch, transformers): {exc}")
    cfg = _config(options)
    if cfg.target == "default":
        from ovdflash_models.default import DEFAULT_TARGET_FETCH

        cfg.target = str(DEFAULT_TARGET_FETCH())
    if evaluate_only:
        click.echo(json.dumps(evaluate_checkpoint(cfg.out_dir, cfg.target, cfg.eval_dirs or cfg.data_dirs,
                                                  device=cfg.device, features_root=cfg.features_root,
                                                  block_len=eval_block_len), indent=1))
        return
    if cfg.max_steps is None and cfg.minutes is None:
        raise click.UsageError("give --steps or --minutes")
    if cfg.ce_vocab_size and not cfg.vocab_subset:
        raise click.UsageError("--ce-vocab-size sets the size of the vocab subset: drop --no-vocab-subset")
    out = run_training(cfg, log=lambda s: click.echo(s, err=True))
    click.echo(str(out))
