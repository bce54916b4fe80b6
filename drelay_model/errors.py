"""User-facing errors.

Anything a user can get wrong (a target spec, a checkpoint, a prompt, a config value) raises
`DRelayError` with a one-line message that names the offending field or path. Entry points (the
`drelay` CLI, the Serve app) print the message and exit non-zero / answer 4xx; they never show a
traceback for a `DRelayError`.
"""


class DRelayError(Exception):
    """A problem with the user's input; the message names what is wrong."""
