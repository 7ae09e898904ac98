"""torch's thread count, set for a block and restored after (``collect`` and ``train`` run inside
larger programs: the quickstart, the tests, a user's script)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run torch with ``n`` threads inside the block (None: as it is), the caller's setting after."""
    import torch  # here, not at the top: commands refuse bad input before paying for torch's import

    before = torch.get_num_threads()
    torch.set_num_threads(n or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)
