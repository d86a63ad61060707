class RefengineError(ValueError):
    """A bad input: the message names the file, tensor, field or request at fault."""
