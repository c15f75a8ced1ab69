"""A template's ``retryStrategy`` as Argo's controller applies it (``processNodeRetries``).

``limit`` more attempts after ``backoff.duration * factor**n`` (capped by ``cap``).
``backoff.maxDuration`` is a deadline from the first attempt's start: no retry once it has
passed ("Max duration limit exceeded") or when the wait would pass it, and an attempt after
the first is stopped when it passes. ``retryPolicy``: Always retries failures and errors,
OnFailure (the default without an expression) a non-zero exit, OnError/OnTransientError an
error of the runner (artifact transfer, missing output). An ``expression`` over
``lastRetry.*`` must also hold; ``lastRetry.exitCode`` is ``-1`` for an attempt whose step
never ran (an input that failed to load), as in ``buildRetryStrategyLocalScope``.
"""
from __future__ import annotations

from dataclasses import dataclass

from emulator.errors import LocalRunError
from emulator.expr import eval_retry, substitute
from emulator.results import NodeResult
from emulator.spec import duration_seconds


@dataclass(frozen=True)
class RetryPlan:
    limit: int = 0                  # attempts after the first
    retrying: bool = False          # a retryStrategy exists: node names get "(N)"
    policy: str = "OnFailure"
    expression: str | None = None
    where: str = ""
    duration: float = 0.0           # backoff before the first retry, seconds
    factor: float = 1.0
    cap: float | None = None
    max_duration: float | None = None

    @classmethod
    def of(cls, template: dict, template_name: str, scope: dict) -> "RetryPlan":
        spec = template.get("retryStrategy")
        if spec is None:
            return cls()
        where = f"spec.templates[{template_name}].retryStrategy"
        raw = substitute(str(spec.get("limit", 0)), scope, f"{where}.limit")
        try:
            limit = int(raw)
        except ValueError:
            raise LocalRunError(f"{where}.limit: {raw!r} is not an integer") from None
        backoff = spec.get("backoff") or {}

        def seconds(key: str) -> float | None:
            return duration_seconds(backoff[key], f"{where}.backoff.{key}") \
                if key in backoff else None

        return cls(limit=max(limit, 0), retrying=True,
                   policy=spec.get("retryPolicy") or ("Always" if spec.get("expression")
                                                      else "OnFailure"),
                   expression=spec.get("expression"), where=where,
                   duration=seconds("duration") or 0.0,
                   factor=float(backoff.get("factor", 1) or 1), cap=seconds("cap"),
                   max_duration=seconds("maxDuration"))

    def wait(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0-based)."""
        wait = self.duration * self.factor ** attempt
        return min(wait, self.cap) if self.cap is not None else wait

    def allows(self, node: NodeResult, exit_code: int | None) -> bool:
        """Whether the policy and expression retry the attempt that just ended."""
        ok = (self.policy == "Always" or (self.policy == "OnFailure" and node.phase == "Failed")
              or (self.policy in ("OnError", "OnTransientError") and node.phase == "Error"))
        if ok and self.expression:
            last = {"exitCode": "-1" if exit_code is None else str(exit_code),
                    "status": node.phase, "message": node.message,
                    "duration": f"{node.seconds:.0f}"}
            ok = eval_retry(self.expression, last, f"{self.where}.expression")
        return ok
