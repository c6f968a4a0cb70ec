"""The findings `requant verify` collects: one line per kind of problem, with a few examples."""

from __future__ import annotations

from dataclasses import dataclass, field

SEVERITIES = ("error", "warning", "info")
EXAMPLES = 5


@dataclass
class Finding:
    severity: str
    code: str
    message: str
    count: int = 0
    examples: list[str] = field(default_factory=list)


class Findings:
    """Findings grouped by (severity, code, message): one line per kind, with a few tensor names."""

    def __init__(self):
        self._by_key: dict[tuple, Finding] = {}

    def add(self, severity: str, code: str, message: str, where: str | None = None, detail: str | None = None):
        f = self._by_key.setdefault((severity, code, message), Finding(severity, code, message))
        f.count += 1
        if len(f.examples) < EXAMPLES and (where or detail):
            f.examples.append(f"{where}: {detail}" if where and detail else where or detail)

    def sorted(self) -> list[Finding]:
        return sorted(self._by_key.values(), key=lambda f: SEVERITIES.index(f.severity))

    def count(self, severity: str) -> int:
        return sum(1 for f in self._by_key.values() if f.severity == severity)
