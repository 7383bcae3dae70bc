"""Command line entry point: `ovdflash export|chat|serve|bench|bench-serve|train|verify|env`.

Each subcommand lives in its own module and is imported only when it runs, so
`ovdflash chat` never pays for (or needs) the export stage's torch import.
"""
import importlib

import click

# subcommand name -> (module, attribute, one-line help)
_COMMANDS = {
    "export": ("ovdflash.cli.export", "export", "Export a target LLM and its DFlash drafter to OpenVINO IR."),
    "chat": ("ovdflash.cli.chat", "chat", "Chat with a model directory (default: SmolLM2-135M + shipped drafter)."),
    "bench": ("ovdflash.cli.bench", "bench", "Benchmark DFlash against autoregressive baselines."),
    "train": ("ovdflash.cli.train", "train", "Distill a DFlash drafter for a target model."),
    "serve": ("ovdflash.cli.serve", "serve", "Serve a model directory as an OpenAI-compatible API (DFlash inside)."),
    "bench-serve": ("ovdflash.cli.bench_serve", "bench_serve", "Load-test any OpenAI-compatible endpoint (TTFT, TPOT, tok/s)."),
    "verify": ("ovdflash.cli.verify", "verify", "Check a model directory's IR files against its recorded checksums."),
    "env": ("ovdflash.cli.env", "env", "Print the host's CPU, ISA, versions and a model's compile precisions."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(_COMMANDS)

    def get_command(self, ctx, name):
        if name not in _COMMANDS:
            return None
        module, attr, _ = _COMMANDS[name]
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError as exc:  # a subcommand not built yet, or an extra not installed
            reason = str(exc)  # `exc` is unbound once the except block ends

            @click.command(name=name, help=_COMMANDS[name][2])
            def _missing():
                raise click.ClickException(f"`ovdflash {name}` is unavailable: {reason}")
            return _missing


@click.group(cls=_LazyGroup)
@click.version_option(package_name="ovdflash")
def main():
    """Lossless DFlash speculative decoding on CPUs with OpenVINO."""


if __name__ == "__main__":
    main()
