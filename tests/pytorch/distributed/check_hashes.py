"""Check that every rank of a run of ``run_multi_device_fp8.py`` printed the same FINAL_HASH.

Reads torchrun output: files (a captured console log, with or without torchrun's ``--tee``
prefixes such as ``[default0]:``) and directories (every ``stdout.log`` under them: the per-rank
files of torchrun's ``--log-dir``; or ``rank*.log`` / ``rank*.txt`` files, one per rank)::

    python tests/pytorch/distributed/check_hashes.py --world-size 2 run.log
    python tests/pytorch/distributed/check_hashes.py --world-size 2 /path/to/torchrun-log-dir

Passes (exit 0) when there is at least one ``FINAL_HASH <64 hex digits>`` line, exactly
``--world-size`` of them when that is given, no rank (``--tee`` prefix) printed twice, and all of
them are equal. Otherwise it lists what it found and exits 1.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

HASH_LINE = re.compile(r"(?:^\[(?P<tag>[^\]\s]+)\]:)?.*?FINAL_HASH (?P<hash>[0-9a-f]{64})\b")
PER_RANK_FILES = ("stdout.log", "rank*.log", "rank*.txt")


def find_hashes(text: str, source: str) -> list[tuple[str, str, str | None]]:
    """``(where, hash, tag)`` for every FINAL_HASH line of ``text`` (``tag``: the ``--tee``
    prefix naming the rank, or ``None``)."""
    found = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        match = HASH_LINE.search(line)
        if match:
            found.append((f"{source}:{lineno}", match["hash"], match["tag"]))
    return found


def source_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted({f for pattern in PER_RANK_FILES for f in path.rglob(pattern)})
        if not files:
            raise FileNotFoundError(f"{path}: no {' / '.join(PER_RANK_FILES)} files under it")
        return files
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file or directory")
    return [path]


def collect(paths) -> list[tuple[str, str, str | None]]:
    """Every FINAL_HASH line of every file (or per-rank file under every directory), as
    ``(where, hash, rank key)``; the rank key (``None`` when unknown) names the printing rank:
    the file and ``--tee`` prefix, or the per-rank file found under a directory."""
    found = []
    for path in map(Path, paths):
        per_rank = path.is_dir()
        for file in source_files(path):
            for where, h, tag in find_hashes(file.read_text(errors="replace"), str(file)):
                key = f"{file} [{tag}]" if tag else (str(file) if per_rank else None)
                found.append((where, h, key))
    return found


def problems(found, world_size: int | None = None) -> list[str]:
    """Why ``found`` does not show ranks agreeing on one hash (empty when it does)."""
    out = []
    if not found:
        return ["no FINAL_HASH line found"]
    if world_size is not None and len(found) != world_size:
        out.append(f"{len(found)} FINAL_HASH lines for a world of {world_size} ranks")
    repeated = [key for key, n in Counter(k for _, _, k in found if k).items() if n > 1]
    if repeated:
        out.append(f"ranks printed FINAL_HASH more than once: {repeated}")
    if len({h for _, h, _ in found}) != 1:
        out.append("ranks disagree: " + "; ".join(f"{where}: {h}" for where, h, _ in found))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="torchrun console logs or --log-dir folders")
    parser.add_argument("--world-size", type=int, help="the number of ranks that must report")
    args = parser.parse_args(argv)
    try:
        found = collect(args.paths)
    except FileNotFoundError as err:
        print(f"FINAL_HASH check FAILED: {err}")
        return 1
    failed = problems(found, args.world_size)
    if failed:
        print("FINAL_HASH check FAILED: " + " | ".join(failed))
        return 1
    print(f"FINAL_HASH check passed: {len(found)} ranks agree on {found[0][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
