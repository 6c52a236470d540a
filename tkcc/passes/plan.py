"""PassPlan: the recipe of a candidate — an ordered list of (pass name, params)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PassStep:
    name: str
    params: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "params": dict(sorted(self.params.items()))}


@dataclass(frozen=True)
class PassPlan:
    """Ordered pass applications. JSON round-trips; ``hash()`` names the candidate."""

    steps: tuple[PassStep, ...] = ()

    @classmethod
    def of(cls, *steps: tuple[str, dict] | str) -> "PassPlan":
        out = []
        for s in steps:
            out.append(PassStep(s, {}) if isinstance(s, str) else PassStep(s[0], dict(s[1])))
        return cls(tuple(out))

    def to_json(self) -> list[dict]:
        return [s.to_json() for s in self.steps]

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def from_json(cls, data: list | str) -> "PassPlan":
        from tkcc.errors import PlanError

        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise PlanError(f"pass plan is not valid JSON: {e}") from e
        if not isinstance(data, list):
            raise PlanError(f"a pass plan is a JSON list of {{name, params}}, got {type(data).__name__}")
        steps = []
        for i, item in enumerate(data):
            if not isinstance(item, dict) or "name" not in item:
                raise PlanError(f"plan step {i + 1}: expected {{'name': ..., 'params': {{...}}}}, got {item!r}")
            params = item.get("params", {})
            if not isinstance(params, dict):
                raise PlanError(f"plan step {i + 1} ({item['name']}): params must be an object")
            steps.append(PassStep(str(item["name"]), dict(params)))
        return cls(tuple(steps))

    def hash(self) -> str:
        return hashlib.sha256(self.dumps().encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.steps)
