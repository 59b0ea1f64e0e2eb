"""The README and docs/ pages name only options that exist, and their links resolve.

An option named in the documentation (`network_dim`, `--network_dim 16`, `optimizer_type =
"AdamW"`) must be a schema option, an sd-scripts name the schema knows, a kohya_ss GUI key, a
dataset-config key, a `network_args` key or a flag of one of the project's scripts. Everything
else that looks like one (a function, a metadata key, an optimizer argument) is either defined in
this repository's code or listed in NOT_OPTIONS below, so a misspelt option is caught.
docs/OPTIONS.md is generated from the schema (tests/config/test_config.py checks it) and is skipped.
"""
import difflib
import glob
import os
import re

from tests.conftest import ROOT

# backticked words that look like options but are not: other libraries' APIs and arguments,
# scheduler and preset values, sd-scripts' function names, kohya file keys, math symbols.
NOT_OPTIONS = {
    # torch, diffusers, transformers, accelerate, DeepSpeed, safetensors
    "register_post_accumulate_grad_hook", "saved_tensors_hooks", "fully_shard", "float8_e4m3fn",
    "max_memory_allocated", "load_lora_weights", "weights_only", "enable_gradient_checkpointing",
    "text_encoder_2", "tokenizer_2", "text_model", "proj_in", "proj_out", "skip_connection",
    "input_blocks", "middle_block", "output_blocks", "use_fsdp", "gradient_clipping",
    "overlap_comm", "zero_optimization", "lr_end", "machine_rank", "dist", "main_process_ip", "cpu",
    # optimizer and scheduler arguments (optimizer_args / lr_scheduler_args values)
    "relative_step", "scale_parameter", "warmup_init", "warmup_steps", "min_8bit_size",
    "step_rules", "bypass_mode", "use_tucker",
    # transformers' scheduler names that sd-scripts' get_scheduler_fix cannot call
    "reduce_lr_on_plateau", "cosine_warmup_with_min_lr",
    # sd-scripts' functions, compared against in the docs
    "get_optimizer", "get_scheduler_fix", "apply_masked_loss", "create_network_from_weights",
    "get_hidden_states", "get_weighted_text_embeddings", "prepare_grad_etc", "process_caption",
    "verify_bucket_reso_steps", "svd_merge", "show_metadata", "setup_parser",
    # resize_lora's --dynamic_method values
    "sv_fro", "sv_ratio", "sv_cumulative",
    # sd-scripts' default log_tracker_name of train_network.py
    "network_train",
    "get_block_index", "tokenize_with_weights", "encode_tokens_with_weights",
    # U-Net module names, block-weight presets
    "conv_in", "conv_out", "mid_block", "time_embed", "label_emb", "reverse_linear",
    # sample prompt-file options (`--n` negative prompt, `--w` width, ...; sd-scripts' syntax)
    "n", "w", "h", "d", "s", "l", "ss", "i", "g",
    # Lumina 2's (`--ctr` CFG truncation ratio, `--rcfg` renorm factor) and diffusers' Lumina2Pipeline
    # argument that differs from the latter
    "ctr", "rcfg", "cfg_normalization",
    # gen_img's own prompt-line options (`--am` network multipliers, `--nl` negative scale)
    "am", "nl",
    # textual inversion's names of a multi-vector token's extra tokens
    "tok_1", "tok_2",
    # symbols in formulas
    "s_i", "sum_i", "old_alpha", "latent_mask", "max_norm",
}
# prefixes of kohya LoRA file keys and metadata keys (`ss_network_dim`, `lora_unet_...`)
NOT_OPTION_PREFIXES = ("ss_", "sshs_", "lora_", "modelspec_")

# a backticked span that starts with a snake_case word: `name`, `--name value`, `name = value`
LEADING_NAME = re.compile(r"^(?:--)?([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?:\s*=.*|\s+\S.*)?$")
FLAG = re.compile(r"(?<![\w-])--([a-z](?:[a-z0-9_-]*[a-z0-9])?)")
SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def doc_files() -> list[str]:
    files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return [f for f in files if os.path.basename(f) != "OPTIONS.md"]


def code_names(root: str = ROOT) -> set[str]:
    """Every snake_case identifier of this repository's Python code outside tests/ (functions,
    attributes, arguments, state keys): the docs may name them. A misspelt option is none of
    them."""
    names = set()
    for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        if "/.venv/" in f or "/tests/" in f:
            continue
        with open(f, encoding="utf-8") as fh:
            names |= set(re.findall(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", fh.read()))
    return names


def script_flags() -> set[str]:
    """Flags the project's own scripts (tools, networks, benchmarks) and accelerate take."""
    flags = {"num_processes", "use_deepspeed", "zero_stage", "multi_gpu", "use_fsdp", "config", "help"}
    for f in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True):
        if "/.venv/" in f:
            continue
        with open(f, encoding="utf-8") as fh:
            flags |= set(re.findall(r"add_argument\(\s*\"--([a-z0-9_-]+)\"", fh.read()))
    return flags


def option_names() -> set[str]:
    from library.config import dataset_config
    from library.config import options
    from networks.lora import KNOWN_NETWORK_ARGS

    return (set(options.OPTIONS_BY_NAME) | set(options.ALIASES)
            | {n.name for n in options.SD_SCRIPTS_NAMES} | set(options.GUI_KEYS_BY_NAME)
            | set(options.LR_SCHEDULERS) | set(dataset_config.SUBSET_KEYS)
            | set(dataset_config.DATASET_KEYS) | set(dataset_config.ALIASES)
            | set(dataset_config.UNSUPPORTED) | set(KNOWN_NETWORK_ARGS))


def named_options(text: str) -> list[str]:
    """The option-like names a page uses: the leading snake_case word of each backticked span,
    and every --flag in backticked spans and fenced code blocks."""
    found = []
    for span in SPAN.findall(text):
        m = LEADING_NAME.match(span.strip())
        if m:
            found.append(m.group(1))
        found += FLAG.findall(span)
    for block in FENCE.findall(text):
        found += FLAG.findall(block)
    return found


def unknown_names(text: str, known: set[str]) -> list[str]:
    out = []
    for name in named_options(text):
        if name in known or name in NOT_OPTIONS or name.startswith(NOT_OPTION_PREFIXES):
            continue
        if name not in out:
            out.append(name)
    return out


def test_docs_name_only_existing_options():
    known = option_names() | script_flags() | code_names()
    problems = []
    for f in doc_files():
        with open(f, encoding="utf-8") as fh:
            for name in unknown_names(fh.read(), known):
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                problems.append(f"{os.path.relpath(f, ROOT)}: `{name}`{hint}")
    assert not problems, ("not an option, sd-scripts name, GUI key or script flag (fix it, or add "
                          "it to NOT_OPTIONS in tests/test_docs.py if it is not meant as one):\n"
                          + "\n".join(problems))


def test_a_misspelt_option_is_found():
    known = option_names() | script_flags()
    text = ("Set `network_dim = 8`, `netwrok_alpha`, `--learning_rate 1e-4` and `lr_sheduler`.\n"
            "```bash\npython train_lora.py --config run.toml --max_train_step 10\n```\n")
    assert unknown_names(text, known) == ["netwrok_alpha", "lr_sheduler", "max_train_step"]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as fh:
        text = FENCE.sub("", fh.read())
    return {_anchor(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M)}


def test_links_resolve_and_readme_indexes_every_page():
    problems = []
    for f in doc_files() + [os.path.join(ROOT, "docs", "OPTIONS.md")]:
        with open(f, encoding="utf-8") as fh:
            text = FENCE.sub("", fh.read())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
            if not os.path.exists(full):
                problems.append(f"{os.path.relpath(f, ROOT)}: link to missing {target}")
            elif anchor and full.endswith(".md") and anchor not in _anchors(full):
                problems.append(f"{os.path.relpath(f, ROOT)}: no heading for #{anchor} in {path or 'itself'}")
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    for page in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        if f"](docs/{os.path.basename(page)})" not in readme:
            problems.append(f"README.md: the docs index has no line for docs/{os.path.basename(page)}")
    assert not problems, "\n".join(problems)
    # "under 15 KB" (issue 14): set-up, step plan, main options, results; the reference is in docs/
    assert len(readme.encode()) < 15 * 1024, "README.md over 15 KiB: move detail into a docs/ page"


# sd-scripts' own files, named where the docs compare with it (not files of this repository)
SD_SCRIPTS_FILES = {"library/train_util.py", "library/utils.py", "library/lpw_stable_diffusion.py"}
REPO_PATH = re.compile(r"(?<![\w/.])((?:tests|library|tools|networks|benchmarks|configs|\.ci)/[\w./-]*\w)")


def test_files_named_in_the_docs_exist():
    problems = []
    for f in doc_files():
        with open(f, encoding="utf-8") as fh:
            for path in sorted(set(REPO_PATH.findall(fh.read())) - SD_SCRIPTS_FILES):
                if not os.path.exists(os.path.join(ROOT, path)):
                    problems.append(f"{os.path.relpath(f, ROOT)}: {path} does not exist")
    assert not problems, "\n".join(problems)


# sd-scripts' own files that the code names where it follows them (not files of this repository)
SD_SCRIPTS_CODE_FILES = SD_SCRIPTS_FILES | {
    "library/flux_utils.py", "library/leco_train_util.py", "library/sai_model_spec.py",
    "library/mask_generator.py", "library/flux_models.py", "library/sd3_models.py",
    "library/flux_train_utils.py", "library/sd3_train_utils.py", "library/custom_train_functions.py",
    "library/huggingface_util.py"}


def _first_party_sources() -> list[str]:
    out = []
    for top in ("library", "networks", "tools", "benchmarks"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            out += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    return sorted(out)


def test_paths_named_in_the_code_exist():
    """A repository path in a comment or docstring (library/..., docs/..., tests/...) names a file
    or folder that exists (a module path with an attribute, library/x.py's ``f``, counts by its
    module); sd-scripts' own files are the exceptions above."""
    pattern = re.compile(r"(?<![\w/.-])((?:library|networks|tools|benchmarks|tests|configs|docs)/[\w./-]*\w)")
    problems = []
    for f in _first_party_sources():
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                for path in pattern.findall(line):
                    base = path.rsplit(".", 1)[0] if "." in os.path.basename(path) else path
                    if path in SD_SCRIPTS_CODE_FILES or any(
                            os.path.exists(os.path.join(ROOT, c)) for c in (path, base, base + ".py")):
                        continue
                    problems.append(f"{os.path.relpath(f, ROOT)}:{n}: {path}")
    assert not problems, "paths that do not exist:\n" + "\n".join(problems)


def test_the_module_map_names_every_module():
    """docs/INTERNALS.md's module map names every module of library/ and networks/: by its path,
    or by its file name in a row that names its folder (`library/models/t5.py`, `clip_l_file.py`)."""
    with open(os.path.join(ROOT, "docs", "INTERNALS.md"), encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    missing = []
    for f in _first_party_sources():
        rel = os.path.relpath(f, ROOT).replace(os.sep, "/")
        if not rel.startswith(("library/", "networks/")) or rel.endswith("__init__.py"):
            continue
        folder, name = rel.rsplit("/", 1)
        if not any(rel in ln or (f"`{folder}/" in ln and f"`{name}`" in ln) for ln in lines):
            missing.append(rel)
    assert not missing, "docs/INTERNALS.md's module map lacks " + ", ".join(missing)


def test_readme_keeps_the_ci_test_command():
    """.ci/run executes the first line of the bash block after the marker."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    m = re.search(r"<!-- test-command -->\n```bash\n([^\n]+)\n```", readme)
    assert m, "README.md: no ```bash block right after <!-- test-command --> (.ci/run reads it)"
    # two pytest-xdist workers, one per core of CI's 2-core machine; a file stays on one worker
    # (its module fixtures run once)
    # the ui extra: the API and browser tests (tests/ui) run in CI
    assert 'pip install -e ".[test,ui]"' in m.group(1) and \
        m.group(1).endswith("python -m pytest -q -n 2 --dist loadfile")
