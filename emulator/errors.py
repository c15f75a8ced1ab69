"""The local runner's one error type: a one-line, user-fixable fault (a StepError)."""
from __future__ import annotations

from steps.errors import StepError


class LocalRunError(StepError):
    """The Workflow uses something the local runner cannot run, or a run cannot start.

    The message is one line naming the field, e.g.
    ``spec.templates[train].script: script templates are not supported``.
    """
