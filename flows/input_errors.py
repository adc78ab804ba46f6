"""The error every pre-start check raises: bad input, reported in one line before any worker starts."""


class PreflightError(ValueError):
    """A command's input is wrong; the message is one line, phrased for the user."""
