"""Create a plugin from plugins/_template: ``python scripts/new_plugin.py KIND NAME [--dest DIR]``.

KIND is one of reward, generate, sandbox, agent, weightsync, trainer, advantage (free text is accepted);
NAME is the plugin's short name (``tests``, ``docker``). The result is ``DEST/vime-KIND-NAME`` with the import
package ``vime_KIND_NAME`` and the entry point ``KIND-NAME``.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1] / "plugins" / "_template"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind")
    ap.add_argument("name")
    ap.add_argument("--dest", type=Path, default=TEMPLATE.parent)
    a = ap.parse_args()
    for value in (a.kind, a.name):
        if not re.fullmatch(r"[a-z][a-z0-9-]*", value):
            raise SystemExit(f"new_plugin: {value!r}: use lower-case letters, digits and dashes")
    ident_kind, ident_name = a.kind.replace("-", "_"), a.name.replace("-", "_")
    dest = a.dest / f"vime-{a.kind}-{a.name}"
    if dest.exists():
        raise SystemExit(f"new_plugin: {dest} exists")
    shutil.copytree(TEMPLATE, dest)
    pkg = dest / "src" / "vime_KIND_NAME"
    pkg.rename(dest / "src" / f"vime_{ident_kind}_{ident_name}")
    for path in dest.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".toml", ".md"):
            text = path.read_text()
            text = text.replace("vime_KIND_NAME", f"vime_{ident_kind}_{ident_name}")
            text = text.replace("KIND-NAME", f"{a.kind}-{a.name}").replace("NAME_reward", f"{ident_name}_reward")
            text = text.replace("KIND", a.kind).replace("NAME", a.name)
            path.write_text(text)
    print(dest)


if __name__ == "__main__":
    main()
