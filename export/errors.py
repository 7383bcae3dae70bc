"""The export's input errors: what the CLI reports as one line ``Error: ...`` (exit code 2).

Contract: `ExportError` (a ``ValueError``) for any input problem of an export (a missing file, an
unusable option or source); `PairMismatchError` (an `ExportError`) for a target and drafter that do
not fit together. Every export module raises these; this module imports nothing.
"""


class ExportError(ValueError):
    """An export input problem the CLI reports as one line (exit code 2)."""


class PairMismatchError(ExportError):
    """Target and drafter do not fit together."""
