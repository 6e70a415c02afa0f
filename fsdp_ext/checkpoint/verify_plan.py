"""Which rank checks which file's checksum on a load: each file once, by a rank that reads it.

Every rank that reads a file checks its size; one of them also reads it whole and checks
its CRC-32 before serving it. A flipped byte on disk is the same for every reader, and a
rank whose check fails fails the whole ``dcp.load`` on every rank (DCP gathers the read
step's errors), so one check per file is enough, and the hashing is divided instead of
repeated by each reader (a fully replicated load would otherwise hash the checkpoint
``world`` times). Files go largest first to the reader with the fewest bytes to check,
except that a file's own writer takes it when that costs at most half the file in balance:
in a load into the layout it was saved from, the writer needs the whole file anyway, while
other readers read only their slices (the locality that made Composer revert its spread
writes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# A file's writer checks it if its load of bytes to check stays within this fraction of
# the file of the least-loaded reader's.
LOCALITY_SLACK = 0.5


def assign_checks(
    reads: Sequence[Mapping[str, int]],
    sizes: Mapping[str, int],
    writers: Mapping[str, int],
) -> list[set[str]]:
    """Per rank, the files whose checksum it checks.

    ``reads[r]`` maps each file rank ``r`` reads to the bytes it reads from it; ``sizes``
    and ``writers`` come from the manifest. Deterministic; every file read by anyone is
    assigned to exactly one of its readers.
    """
    load = [0] * len(reads)
    out: list[set[str]] = [set() for _ in reads]
    files = sorted({f for r in reads for f in r}, key=lambda f: (-sizes.get(f, 0), f))
    for name in files:
        readers = [r for r, wanted in enumerate(reads) if name in wanted]
        size = sizes.get(name, 0)
        best = min(readers, key=lambda r: (load[r], r))
        writer = writers.get(name)
        if writer in readers and load[writer] <= load[best] + LOCALITY_SLACK * size:
            best = writer
        out[best].add(name)
        load[best] += size
    return out
