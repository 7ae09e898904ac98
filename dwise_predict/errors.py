"""Typed errors for user mistakes.

Library code raises these and never prints or exits; the CLI entry point maps each to one line on
stderr and exit code 1 (a full traceback only when ``DWISE_DEBUG=1``). A message says what is wrong
and what to do about it.
"""


class DwiseError(Exception):
    """Base class: an error a user can fix."""


class InputError(DwiseError):
    """A file, argument or option holds something we cannot use."""


class TraceError(InputError):
    """A trace dataset breaks contract 1 (missing files, columns, mismatched rows, non-finite values)."""


class ModelError(InputError):
    """A model directory is missing, or is not a block-diffusion LM we can drive."""


class ConfigError(InputError):
    """Decoding, training or scheduling options that cannot work together."""


class BundleError(DwiseError):
    """A predictor bundle is corrupt, tampered with, or built for another model."""


class StoreError(DwiseError):
    """The output directory is locked by another writer, unwritable, or holds other traces."""


class LockHeldError(StoreError):
    """Another process holds the lock (waiting may help; a lock file that is a link never will)."""


class WorkerError(DwiseError):
    """A worker process died under a command (killed, or out of memory); rerunning resumes."""
