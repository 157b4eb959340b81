"""Orbax checkpoints of a run whose faults stop the run at once, in one line.

:class:`Checkpoints` wraps an ``ocp.CheckpointManager``:

* the directory is checked before use: a plain file where it should be, or a directory that
  cannot be written (probed with a temporary file), raises :class:`CheckpointError`;
* saves are asynchronous, but their directories are created synchronously, so a failing
  directory raises in :meth:`Checkpoints.save` instead of leaving orbax's background threads
  waiting for a signal that never comes; errors of the background writes are re-raised, as
  :class:`CheckpointError`, by the next :meth:`Checkpoints.save` or :meth:`Checkpoints.wait`;
* :meth:`Checkpoints.restore_latest` skips damaged (empty, partial, corrupted) checkpoints for
  the newest readable one with a :class:`DamagedCheckpointWarning`, and refuses with a
  :class:`CheckpointError` when none is readable.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from train.rundir import RunError


class CheckpointError(RunError):
    """A checkpoint directory that cannot be written or read."""


class DamagedCheckpointWarning(UserWarning):
    """A checkpoint that cannot be read was skipped for an older one."""


def reason(error: BaseException) -> str:
    """A one-line reason for ``error``: the first OS error in its chain, else its first line."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return str(e)
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    lines = str(error).strip().splitlines() or [type(error).__name__]
    text = lines[0]
    return text if len(text) <= 160 else text[:157] + "..."


@contextlib.contextmanager
def _reported(what: str) -> Iterator[None]:
    """Re-raises any error of the block as a one-line :class:`CheckpointError`."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # orbax and TensorStore raise many types, some plain Exception
        raise CheckpointError(f"{what}: {reason(e)}") from e


def check_writable(directory: Path) -> None:
    """Raises :class:`CheckpointError` unless ``directory`` is (or can be made) a writable directory."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} is not a directory")
    with _reported(f"cannot write checkpoints to {directory}"):
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass


class Checkpoints:
    """The checkpoints of one run (``params`` and ``opt_state``), keeping the last two.

    ``write=False`` opens them read-only (for evaluation and sampling): nothing is created,
    cleaned or moved.
    """

    def __init__(self, directory: Path, *, write: bool) -> None:
        self.directory, self.write = directory, write
        if write:
            check_writable(directory)
        elif directory.exists() and not directory.is_dir():
            raise CheckpointError(f"checkpoint directory {directory} is not a directory")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=2,
            create=write,  # reading creates nothing (and cleans nothing)
            cleanup_tmp_directories=write,  # saves a crash left unfinished
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        with _reported(f"cannot open checkpoints in {directory}"):
            # One item with a fixed handler: a damaged step cannot confuse the manager's item inference
            self.manager = ocp.CheckpointManager(
                directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
            )

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            with _reported(f"cannot finish writing checkpoints to {self.directory}"):
                self.manager.close()
        except CheckpointError:
            if exc[0] is None:  # an error already on its way is the one to report
                raise

    def steps(self) -> list[int]:
        """The saved steps, newest first."""
        with _reported(f"cannot list checkpoints in {self.directory}"):
            return sorted(self.manager.all_steps(), reverse=True)

    def load(self, step: int, like: dict) -> dict:
        """Restores checkpoint ``step`` into the structure (and shardings) of ``like``."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        with _reported(f"checkpoint step {step} in {self.directory} cannot be read"):
            return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def restore_latest(self, like: dict, *, quarantine: Path | None = None) -> tuple[int, Any]:
        """``(step, state)`` of the newest readable checkpoint, or ``(0, None)`` when there is none.

        Damaged checkpoints are skipped with a :class:`DamagedCheckpointWarning` (and, given
        ``quarantine``, moved there so that the run can save those steps again); when every
        checkpoint is damaged, raises :class:`CheckpointError`.
        """
        damaged = []
        for step in self.steps():
            try:
                state = self.load(step, like)
            except CheckpointError as e:
                damaged.append(step)
                warnings.warn(f"{e}; skipped for an older one", DamagedCheckpointWarning, stacklevel=2)
                continue
            self._quarantine(damaged, quarantine)
            return step, state
        if damaged:
            raise CheckpointError(
                f"no readable checkpoint in {self.directory} (steps {', '.join(map(str, damaged))} are damaged): "
                "move the run aside with --config.resume=False, or delete the damaged steps"
            )
        return 0, None

    def _quarantine(self, steps: list[int], where: Path | None) -> None:
        if not steps or where is None or not self.write:
            return
        with _reported(f"cannot move damaged checkpoints out of {self.directory}"):
            where.mkdir(parents=True, exist_ok=True)
            for step in steps:
                n, target = 1, where / str(step)
                while target.exists():
                    n, target = n + 1, where / f"{step}-{n}"
                shutil.move(self.directory / str(step), target)
            self.manager.reload()

    def save(self, step: int, state: dict) -> None:
        """Starts saving ``state`` as ``step`` (in the background); raises earlier saves' errors."""
        with _reported(f"cannot write checkpoint step {step} to {self.directory}"):
            self.manager.save(step, args=ocp.args.StandardSave(state))
            self.manager.check_for_errors()

    def wait(self) -> None:
        """Waits for the background save; raises its error."""
        with _reported(f"cannot write checkpoints to {self.directory}"):
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
