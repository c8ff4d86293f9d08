"""The engine: the handle :class:`Hooks` and its pipeline (plan, forward capture, backward
writer, detached calls, verification), with the records it keeps while it captures."""
