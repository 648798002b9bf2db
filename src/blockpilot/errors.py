"""The one exception type for user mistakes.

A `UserError` is raised for anything the user can fix (a bad path, an empty prompt, a drafter that
does not fit the target, ...). The CLI prints its message on one line and exits with status 2;
every other exception is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake the user can fix; the message says what is wrong and what to do."""
