"""Mistakes a user can fix: entry points catch `UserError` by type and print its message as one line
(exit code 2); anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """Bad input: the message says which value is wrong and what to do instead."""


class DatasetError(UserError):
    """A dataset cannot be found, read or trained on; the message says where it looked and what to do."""


class DiskFull(UserError):
    """A write failed for lack of space (or quota); the message names the path and the fix."""


class NotDistributed(UserError):
    """A script in several processes steps its optimizer outside a process group; the message gives the fix."""


class TrainingDiverged(RuntimeError):
    """The loss stopped being a finite number; the message names the epoch and what to try."""
