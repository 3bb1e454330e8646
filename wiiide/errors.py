"""Typed errors of the WIIIIIDE training system.

Every message says what was wrong and, where it helps, what to do about it. Command-line entry points
turn them into one line on stderr and a non-zero exit code instead of a traceback.
"""


class WiiideError(Exception):
    """Base class of every error raised on purpose by `wiiide`."""


class ConfigError(WiiideError):
    """A configuration value is missing, of the wrong type or out of range.

    The message names the field (e.g. ``sndbuf_bytes``) and what is allowed.
    """


class ProtocolError(WiiideError):
    """A peer sent something that breaks the WIIIIIDE wire protocol.

    Raised for oversized frames, bad magic or version, malformed headers, unknown dtypes or codecs,
    shapes that do not match the payload, or payloads that decompress beyond their declared size.
    The connection it came from is closed; nothing else is affected.
    """


class PeerClosed(ProtocolError):
    """The peer closed the connection (cleanly, between frames, or in the middle of one)."""
