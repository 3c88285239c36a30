"""Every script's argument parser (train/startup.py builds the flag dataclasses' on it; train/launch_local.py, which
starts no JAX, uses it alone): a flag is spelt whole, a mistake is one line naming the closest flag."""

import argparse
import difflib
import re
import sys

# Flags renamed so that one concept has one name in every script and in the library: the old spelling is one line
# naming the new one (in a script that has the new one; elsewhere it is any unknown flag).
RENAMED = {"--cfg": "--guidance", "--cfg_scale": "--guidance", "--cfg_interval": "--guidance_interval"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each flag's default after its help, unless the help
    already says it or there is none ("" or None: unset, the help says what that means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, "", argparse.SUPPRESS) or action.option_strings == []:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Every script's parser: a flag is spelt whole (no prefix matching: `--step 3` is not `--steps 3`), and a
    mistake is argparse's one line without the usage block, an unknown flag naming the closest one there is, a
    renamed one (RENAMED) its new name. `moved`: {flag: the one line saying which script takes it now}."""

    def __init__(self, *args, moved: dict[str, str] | None = None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})
        self.moved = moved or {}

    def parse_known_args(self, args=None, namespace=None):
        words = [str(w) for w in (sys.argv[1:] if args is None else args)]
        words = words[: words.index("--")] if "--" in words else words  # after "--": another script's flags
        flags = {s for a in self._actions for s in a.option_strings}
        for given in (w.partition("=")[0] for w in words if w.startswith("--")):
            if given in self.moved and given not in flags:
                self.error(self.moved[given])
            if given in RENAMED and given not in flags and RENAMED[given] in flags:
                self.error(f"{given} is now {RENAMED[given]} (one name for it in every script and in the library)")
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            given = [w.partition("=")[0] for w in unknown.group(1).split() if w.startswith("-")]
            close = [m for w in given for m in difflib.get_close_matches(w, flags, n=1, cutoff=0.6)]
            message += f" (did you mean {', '.join(dict.fromkeys(close))}?)" if close else " (--help lists the flags)"
        self.exit(2, f"error: {message}\n")
