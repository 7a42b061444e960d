"""Parse an uploaded adapter archive in a child process, under a wall-clock, CPU and memory limit.

:func:`extract` runs ``python -m service.api.archive_sandbox LIMIT MEMORY CPU DIRECTORY`` with the archive on
stdin. The child caps its own address space and CPU time before it reads anything, parses with
service.api.archive and writes the two files into DIRECTORY (an upload directory of
service.engine.adapter_store); the parent kills it at the deadline. Whatever an archive does to a parser,
the serving process neither stalls nor grows: the upload gets a 422.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import resource
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from service.api.archive import ArchiveError, read_adapter_archive
from service.engine.adapter_store import write_files

logger = logging.getLogger(__name__)

CHILD = (sys.executable, "-m", "service.api.archive_sandbox")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the child's working directory: `-m service...` imports
CHILD_BASE_BYTES = 256 * 2**20  # the child's interpreter and imports take ~30 MiB of address space
CHILD_BYTES_PER_LIMIT = 3  # the archive, the stream being decompressed and the files: each at most ~limit
PARSE_BASE_S = 10.0  # interpreter start and slack on a busy machine
PARSE_S_PER_MIB = 0.25  # decompressing and writing run at well over 4 MiB/s on one busy core
EXIT_REJECTED = 2  # the archive broke a rule: the message is on stdout
EXIT_NO_MEMORY = 3
MESSAGE_CHARS = 1000  # of the child's message (names in it are quoted short already)


@dataclass(frozen=True)
class Limits:
    memory_bytes: int  # RLIMIT_AS of the child
    cpu_s: int  # RLIMIT_CPU of the child
    wall_s: float  # killed by the parent after this


def limits_for(limit: int) -> Limits:
    """The child's limits for an upload limit of ``limit`` bytes."""
    wall_s = PARSE_BASE_S + PARSE_S_PER_MIB * limit / 2**20
    return Limits(CHILD_BASE_BYTES + CHILD_BYTES_PER_LIMIT * limit, math.ceil(wall_s), wall_s)


async def extract(data: bytes, limit: int, directory: Path) -> None:
    """Parse ``data`` in a child process and write its two files into ``directory``; ArchiveError if refused."""
    bounds = limits_for(limit)
    args = [str(limit), str(bounds.memory_bytes), str(bounds.cpu_s), str(directory.resolve())]
    process = await asyncio.create_subprocess_exec(
        *CHILD, *args, cwd=PACKAGE_ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(data), bounds.wall_s)
    except TimeoutError:
        raise ArchiveError(f"parsing took longer than {bounds.wall_s:.0f} s") from None
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    status = process.returncode
    if status == 0:
        return
    if status == EXIT_REJECTED:
        raise ArchiveError(out.decode("utf-8", "replace")[:MESSAGE_CHARS])
    if status == EXIT_NO_MEMORY:
        raise ArchiveError(f"parsing needs more than {bounds.memory_bytes // 2**20} MiB of memory")
    if status == -signal.SIGXCPU:
        raise ArchiveError(f"parsing took more than {bounds.cpu_s} s of CPU time")
    logger.error("the archive parser failed with status %s: %s", status, err.decode("utf-8", "replace")[-2000:])
    raise ArchiveError(f"the archive parser failed (status {status})")


def main(argv: list[str]) -> int:
    """The child: limits, then stdin's archive parsed into the directory (exit status: see EXIT_*)."""
    limit, memory_bytes, cpu_s, directory = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    try:
        write_files(read_adapter_archive(sys.stdin.buffer.read(), limit), directory)
    except ArchiveError as exc:
        sys.stdout.write(str(exc))
        return EXIT_REJECTED
    except MemoryError:
        os._exit(EXIT_NO_MEMORY)  # nothing more to allocate: no clean-up, no traceback
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
