"""The probe-side code of the ``vllm serve`` argv check (:mod:`pdsweep.builds.argcheck`): text
that :mod:`pdsweep.builds.attnprobe` puts into its probe script, run by a build's interpreter
(needs nothing of pdsweep). It calls what ``vllm serve`` runs before it loads anything
(``vllm/entrypoints/cli/serve.py`` ``ServeSubcommand``): ``make_arg_parser``,
``validate_parsed_serve_args``, ``AsyncEngineArgs.from_cli_args``."""

from __future__ import annotations

# Where ``vllm/entrypoints/cli/serve.py`` imports ``make_arg_parser`` and
# ``validate_parsed_serve_args`` from, newest first: vLLM 0.34.0, then 0.32.0/0.33.0.
CLI_ARGS_MODULES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")

# Code of the probe process (attnprobe.SCRIPT, which has imported importlib, contextlib, sys,
# json and its stub finder `_finder`): the "argv" kind, {"args": [[serve args]...]} ->
# {"refused": [vLLM's message or None, ...], "parser": module} or {"unavailable": why}.
ARGV_PROBE = r"""
import contextlib
CLI_ARGS_MODULES = %r
class _ArgError(Exception): pass
class _Unavailable(Exception): pass
_SERVE = {}

@contextlib.contextmanager
def _unstubbed():
    # the modules the backend probe stubbed (flashinfer, ...) are hidden while vLLM parses
    sys.meta_path.remove(_finder)
    hidden = {n: sys.modules.pop(n) for n in list(sys.modules) if n.split(".")[0] in _finder.tops}
    try: yield
    finally: sys.modules.update(hidden); sys.meta_path.insert(0, _finder)

def _serve_parser():
    if _SERVE: return _SERVE
    errors = []
    for name in CLI_ARGS_MODULES:
        try: mod = importlib.import_module(name)
        except ImportError as e: errors.append(f"{name}: {e}"); continue
        if hasattr(mod, "make_arg_parser") and hasattr(mod, "validate_parsed_serve_args"): break
        errors.append(f"{name}: no make_arg_parser/validate_parsed_serve_args")
    else: raise _Unavailable("the installed vLLM lacks its CLI parser (" + "; ".join(errors) + ")")
    try: from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e: raise _Unavailable(f"the installed vLLM lacks its CLI parser ({e})")
    try: parser = mod.make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    except RuntimeError as e:  # a CUDA wheel on a CPU box: DeviceConfig "Failed to infer device type"
        raise _Unavailable(f"vLLM could not build its serve parser ({name}.make_arg_parser) here ({e}); "
            "check on a node of the build's platform")
    def error(message): raise _ArgError(f"vllm serve: error: {message}")  # argparse would print usage, exit 2
    parser.error = error
    _SERVE.update(parser=parser, validate=mod.validate_parsed_serve_args, module=name)
    return _SERVE

def _check_argv(args):
    from vllm.engine.arg_utils import AsyncEngineArgs
    s = _serve_parser()
    try:
        ns = s["parser"].parse_args(args)
        if getattr(ns, "model_tag", None) is not None: ns.model = ns.model_tag  # as ServeSubcommand.cmd does
        s["validate"](ns)
        AsyncEngineArgs.from_cli_args(ns)
    except _ArgError as e: return str(e)
    except SystemExit as e: return f"vllm serve exited {e.code} while parsing"
    except Exception as e: return f"{type(e).__name__}: {e}"
    return None

def argv(q):
    with _unstubbed():
        try: return {"refused": [_check_argv(a) for a in q["args"]], "parser": _serve_parser()["module"]}
        except _Unavailable as e: return {"unavailable": str(e)}
KINDS["argv"] = argv
""" % (CLI_ARGS_MODULES,)
