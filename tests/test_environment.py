"""environment.yml and pyproject.toml must ask for the same packages at the same minimum versions."""
import re
import tomllib

import yaml
from course_utils.paths import ROOT



def _split(spec: str) -> tuple[str, str]:
    m = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", spec.strip())
    return m.group(1).lower().replace("_", "-"), m.group(2).replace(" ", "")


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = dict(_split(s) for s in project["dependencies"] + project["optional-dependencies"]["test"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    listed: dict[str, str] = {}
    for dep in env["dependencies"]:
        specs = dep["pip"] if isinstance(dep, dict) else [dep]
        for spec in specs:
            if spec.startswith("-e") or spec.startswith("python=") or spec == "pip":
                continue
            name, version = _split(spec.replace("=", "==", 1) if re.match(r"^[\w\-]+=[^=]", spec) else spec)
            listed[name] = version
    assert listed == wanted, {"only in environment.yml": sorted(set(listed) - set(wanted)),
                              "only in pyproject.toml": sorted(set(wanted) - set(listed)),
                              "different": sorted(k for k in set(listed) & set(wanted) if listed[k] != wanted[k])}


def test_flash_attn_is_optional():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(s.startswith("flash") for s in project["dependencies"])
    assert any(s.startswith("flash-attn") for s in project["optional-dependencies"]["flash"])
