"""Drafter training, the torch side of the export stage: data, prompt pools, features, training.

Modules: `prompts` (the prompt pools, from the word lists in `templates/`), `prompt_files` (how a
pool is stored, read by `prompts` and `data`), `data` (the target's replies stored as token ids),
`textdata` (foreign text in the same format), `features` (target features precomputed by the
deployed OpenVINO target), `config` (the training options, torch-free: `ovdflash train` builds its
command line from it), `train` (the training run) with `target_features`, `batch`, `loss` and
`evaluate`. Importing this package imports nothing heavy; each module imports what it needs.

The command lines' default paths, relative to the repository root: the held-out eval prompts ship
with the runtime (`EVAL_PROMPTS`); the training data lives in one data root outside the installed
package data (`DATA_ROOT`, catalogued in its README.md): prompt pools under `PROMPT_POOLS`, the
target's replies under `SMOLLM2_DATA`, each data set named as the pool it answers.
"""
EVAL_PROMPTS = "models/prompts"
DATA_ROOT = "models/data"
PROMPT_POOLS = f"{DATA_ROOT}/prompts"
SMOLLM2_DATA = f"{DATA_ROOT}/smollm2"
