"""SGLang's STS calibration of the DSpark confidence head: one temperature per block position.

SGLang 0.5.23 reads `--speculative-dspark-confidence-sts-path`, a JSON object
`{"temperatures": [T_1 .. T_gamma], "dataset": str, "num_samples": int, "ece_before": [...],
"ece_after": [...]}`, and computes c_k = sigmoid(raw_k / T_k). `DSparkDrafter(confidence_sts=)`
takes that file (or the temperatures themselves); the temperatures must be gamma finite numbers > 0.
Keys other than those five are refused by name rather than ignored."""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import CheckpointError, InputError

STS_KEYS = ("temperatures", "dataset", "num_samples", "ece_before", "ece_after")


def _check(temps, gamma: int, where: str, error) -> tuple:
    if not isinstance(temps, (list, tuple)) or not temps:
        raise error(f"{where}: temperatures must be a non-empty list of numbers, got {temps!r}")
    for t in temps:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise error(f"{where}: every temperature must be a finite number > 0, got {t!r}")
    if len(temps) != gamma:
        raise error(f"{where}: {len(temps)} temperatures, the module drafts dspark_block_size={gamma} positions "
                    "(one temperature each)")
    return tuple(float(t) for t in temps)


def read_sts(source, gamma: int) -> tuple:
    """The per-position temperatures from SGLang's STS file (a path) or a sequence of numbers."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read it as an STS calibration JSON file ({e})") from e
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: an STS calibration file holds a JSON object, got {type(data).__name__}")
        extra = sorted(set(data) - set(STS_KEYS))
        if extra:
            raise CheckpointError(f"{path}: unknown STS key {extra[0]} (known: {', '.join(STS_KEYS)})")
        if "temperatures" not in data:
            raise CheckpointError(f"{path}: the STS calibration has no temperatures")
        return _check(data["temperatures"], gamma, str(path), CheckpointError)
    return _check(list(source) if isinstance(source, (list, tuple)) else source, gamma, "confidence_sts",
                  InputError)
