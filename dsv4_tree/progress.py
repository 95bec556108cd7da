"""The one progress bar of generate / generate_batch (tqdm, on stderr)."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


def token_bar(total: int, progress, desc: str):
    """progress None: shown when stderr is a terminal; True / False: always / never."""
    show = sys.stderr.isatty() if progress is None else bool(progress)
    return tqdm(total=total, desc=desc, unit="tok", disable=not show, file=sys.stderr, leave=False, dynamic_ncols=True)
