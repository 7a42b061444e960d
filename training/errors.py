"""Errors the CLI reports to the user as one line, without a traceback."""


class UserError(Exception):
    """A problem the user can fix: a missing file or data source, a bad option value."""
