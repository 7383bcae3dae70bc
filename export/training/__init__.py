"""Drafter training, the torch side of the export stage: data, prompt pools, features, training.

Modules: `prompts` (the prompt pools, from the word lists in `templates/`), `data` (the target's
replies stored as token ids), `textdata` (foreign text in the same format), `features` (target
features precomputed by the deployed OpenVINO target), `config` (the training options, torch-free:
`ovdflash train` builds its command line from it), `train` (the training run) with `target`,
`batch`, `loss` and `evaluate`. Importing this package imports nothing heavy; each module
imports what it needs.
"""
