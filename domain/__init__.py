"""Pure domain logic with no I/O: names, errors, config.pbtxt as a message."""
