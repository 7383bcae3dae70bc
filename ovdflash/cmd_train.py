"""`ovdflash train`: distill a DFlash drafter for a Hugging Face target (needs the export extra).

The command only parses options; the work is `ovdflash_export.training.train.train`, imported when the
command runs so that `ovdflash --help` never loads torch. Re-running the same command with the
same --out resumes from `train_state.pt` (model, optimizer, step, schedule position).
"""
import json

import click


def _ids(text):
    return [int(x) for x in text.split(",")] if text else None


@click.command(name="train")
@click.option("--target", required=True,
              help="HF model directory of the target, or 'smollm2' (fetched into the ovdflash cache).")
@click.option("--data", "data_dirs", multiple=True, required=True,
              help="Data directory written by `python -m ovdflash_export.training.data` (repeatable).")
@click.option("--eval-data", "eval_dirs", multiple=True, help="Held-out data directory: tau estimate per domain.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Checkpoint directory (config.json + model.safetensors + train_state.pt).")
@click.option("--state-dir", default=None, type=click.Path(file_okay=False),
              help="Where train_state.pt (optimizer etc., for resuming) goes; default: --out.")
@click.option("--layers", default=1, show_default=True, help="Drafter decoder layers.")
@click.option("--block-size", default=8, show_default=True)
@click.option("--target-layer-ids", default=None, help="Comma list, e.g. 1,8,14,20,27 (default: z-lab formula).")
@click.option("--num-features", default=5, show_default=True, help="Feature layers when ids are not given.")
@click.option("--mask-token-id", type=int, default=None, help="Default: the last embedding row.")
@click.option("--anchors", default=48, show_default=True, help="Anchors (blocks) per sequence per step.")
@click.option("--batch", "batch_seqs", default=8, show_default=True, help="Sequences per step.")
@click.option("--max-len", default=768, show_default=True)
@click.option("--lr", default=6e-4, show_default=True)
@click.option("--warmup", "warmup_steps", default=48, show_default=True)
@click.option("--steps", "max_steps", type=int, default=None, help="Schedule length in steps.")
@click.option("--minutes", type=float, default=None, help="Schedule length in wall-clock minutes.")
@click.option("--gamma", default=4.0, show_default=True, help="Slot weight decay exp(-(k-1)/gamma).")
@click.option("--negatives", "num_negatives", default=1024, show_default=True)
@click.option("--no-vocab-subset", is_flag=True, help="Full-vocabulary CE (slow on CPU).")
@click.option("--no-feature-scaling", is_flag=True)
@click.option("--val-every", default=100, show_default=True)
@click.option("--new-per-step", type=int, default=None,
              help="Sequences with fresh target features per step; the rest reuse cached ones (CPU speed-up).")
@click.option("--reload-every", default=0, show_default=True,
              help="Steps between re-reading --data (0: never); lets training run while data is still generated.")
@click.option("--save-every", "save_every_s", default=180.0, show_default=True, help="Seconds between checkpoints.")
@click.option("--feature-cache-gb", default=4.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--val-seed", type=int, default=None,
              help="Seed of the validation split (held-back prompts); default: the one --init-from recorded, "
                   "else --seed.")
@click.option("--device", default="auto", show_default=True)
@click.option("--threads", type=int, default=None)
@click.option("--autocast", type=click.Choice(["none", "bf16"]), default="none", show_default=True,
              help="Mixed precision for the drafter's training passes (bf16: ~1.3x a step measured on an AMX CPU).")
@click.option("--target-batch", type=click.IntRange(min=0), default=0, show_default=True,
              help="Sequences per torch-target forward for features not precomputed (0: 32 on CUDA, 1 on a CPU).")
@click.option("--init-from", default=None, type=click.Path(exists=True, file_okay=False),
              help="Warm start from this drafter checkpoint (same geometry, or fewer layers: added layers start as "
                   "no-ops); a fresh optimizer and schedule.")
@click.option("--no-relabel", is_flag=True,
              help="Train on the stored tokens instead of the target's greedy chain (see train.py; "
                   "teacher-forced text data needs relabelling).")
@click.option("--features", "features_root", default=None, type=click.Path(exists=True, file_okay=False),
              help="Precomputed OpenVINO target features (python -m ovdflash_export.training.features): one sub-directory "
                   "per data directory's name; those sequences never run the torch target.")
@click.option("--kd-weight", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="Weight of distillation on the target's top-k distributions (those stored with --features "
                   "computed with --topk, else computed by the torch target: --kd-topk); 0 trains on greedy labels only.")
@click.option("--kd-topk", type=click.IntRange(min=1), default=32, show_default=True,
              help="Without stored top-k: how many of the target's most likely next tokens the distillation sees.")
@click.option("--draft-vocab-size", type=click.IntRange(min=1), default=None,
              help="Write a draft vocabulary of the N ids the target's responses use most (default: every id "
                   "the CE trained over); the drafter's head at run time has these rows only.")
@click.option("--ce-vocab-size", type=click.IntRange(min=1), default=None,
              help="Score only the N ids the target's responses use most (no negatives): the CE and "
                   "distillation train exactly the head the runtime applies, which is written as the draft "
                   "vocabulary; a smaller head also makes each step cheaper.")
@click.option("--short-blocks", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="Fraction of training blocks cut to a random length 2..block-1, so the drafter also drafts "
                   "well when the runtime verifies fewer drafts than the block holds.")
@click.option("--eval-block-len", type=click.IntRange(min=2), default=None,
              help="With --evaluate-only: estimate acceptance for blocks of this many tokens (default: the full block).")
@click.option("--evaluate-only", is_flag=True, help="Only print the tau estimate of the checkpoint in --out on --eval-data.")
def train(target, data_dirs, eval_dirs, out_dir, state_dir, layers, block_size, target_layer_ids, num_features, mask_token_id,
          anchors, batch_seqs, max_len, lr, warmup_steps, max_steps, minutes, gamma, num_negatives, no_vocab_subset,
          no_feature_scaling, val_every, new_per_step, reload_every, save_every_s, feature_cache_gb, seed, val_seed, device, threads, autocast, target_batch, init_from, no_relabel, features_root, kd_weight, kd_topk, draft_vocab_size,
          ce_vocab_size, short_blocks, eval_block_len, evaluate_only):
    """Distill a DFlash drafter for a target model."""
    try:
        from ovdflash_export.training.train import TrainConfig, evaluate_checkpoint
        from ovdflash_export.training.train import train as run_training
    except ImportError as exc:
        raise click.ClickException(f"training needs the export extra (torch, transformers): {exc}")
    if target == "smollm2":
        from ovdflash_models.fetch import fetch_smollm2

        target = str(fetch_smollm2())
    if evaluate_only:
        click.echo(json.dumps(evaluate_checkpoint(out_dir, target, list(eval_dirs or data_dirs), device=device,
                                              features_root=features_root, block_len=eval_block_len),
                              indent=1))
        return
    if max_steps is None and minutes is None:
        raise click.UsageError("give --steps or --minutes")
    cfg = TrainConfig(target=target, data_dirs=list(data_dirs), eval_dirs=list(eval_dirs), out_dir=out_dir, state_dir=state_dir,
                      num_layers=layers, block_size=block_size, target_layer_ids=_ids(target_layer_ids),
                      num_features=num_features, mask_token_id=mask_token_id, anchors_per_seq=anchors,
                      batch_seqs=batch_seqs, max_len=max_len, lr=lr, warmup_steps=warmup_steps, max_steps=max_steps,
                      minutes=minutes, gamma=gamma, num_negatives=num_negatives, vocab_subset=not no_vocab_subset,
                      feature_scaling=not no_feature_scaling, val_every=val_every, new_per_step=new_per_step, reload_every=reload_every,
                      save_every_s=save_every_s,
                      feature_cache_gb=feature_cache_gb, seed=seed, val_seed=val_seed, device=device, threads=threads, autocast=autocast, target_batch=target_batch,
                      init_from=init_from, relabel=not no_relabel, features_root=features_root, kd_weight=kd_weight, kd_topk=kd_topk,
                      draft_vocab_size=draft_vocab_size, ce_vocab_size=ce_vocab_size, short_blocks=short_blocks)
    if ce_vocab_size and no_vocab_subset:
        raise click.UsageError("--ce-vocab-size sets the size of the vocab subset: drop --no-vocab-subset")
    out = run_training(cfg, log=lambda s: click.echo(s, err=True))
    click.echo(str(out))
