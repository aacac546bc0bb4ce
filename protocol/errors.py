"""The one error of the wire, apart so that the schema, the codec and the sample's packing all raise it."""


class ProtocolError(ValueError):
    """A received message that tether refuses; the text says why."""
