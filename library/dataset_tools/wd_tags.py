"""From a WD tagger's scores to caption text, as sd-scripts' finetune/tag_images_by_wd14_tagger.py
writes it: tag names prepared once (character expansion, underscores, replacements), then per image
the thresholds, the tag order of each layout, rating / quality tags, undesired and always-first
tags, and the merge with an existing caption (``--append_tags``).

Where sd-scripts 48d368fa is broken this does what its options say: character tags of the
SmilingWolf layout are written (it raises UnboundLocalError), ``--tag_replacement`` replaces (its
helper shadows its own list and changes nothing, or, with tag_mapping.json, renames every tag),
and ``--always_first_tags`` entries are stripped (``1girl, solo`` works as ``1girl,solo``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from library.dataset_tools.wd_model import Labels, TaggerError

_COMMA, _SEMICOLON = "\0comma\0", "\0semicolon\0"


def parse_replacements(spec: str | None) -> tuple[tuple[str, str], ...]:
    """``source1,target1;source2,target2``, with ``\\,`` and ``\\;`` inside names."""
    if not spec:
        return ()
    escaped = spec.replace("\\,", _COMMA).replace("\\;", _SEMICOLON)
    pairs = []
    for part in escaped.split(";"):
        if not part.strip():
            continue
        items = part.split(",")
        if len(items) != 2:
            shown = part.replace(_COMMA, "\\,").replace(_SEMICOLON, "\\;")
            raise TaggerError(f"--tag_replacement: {shown!r} is not source,target (escape a comma "
                              "or semicolon inside a tag as \\, or \\;)")
        src, dst = (t.replace(_COMMA, ",").replace(_SEMICOLON, ";") for t in items)
        pairs.append((src, dst))
    return tuple(pairs)


def split_tags(text: str | None, separator: str) -> list[str]:
    """A tag list option split on the separator without its spaces, each tag stripped."""
    if not text:
        return []
    return [t.strip() for t in text.split(separator.strip() or separator) if t.strip()]


@dataclass(frozen=True)
class TagOptions:
    """The options that decide the caption text (sd-scripts' flags of the same names)."""
    thresh: float = 0.35
    general_threshold: float | None = None     # None: thresh
    character_threshold: float | None = None
    copyright_threshold: float | None = None   # tag_mapping layout only, like the three below
    meta_threshold: float | None = None
    model_threshold: float | None = None
    artist_threshold: float | None = None
    caption_separator: str = ", "
    undesired_tags: str = ""
    always_first_tags: str | None = None
    tag_replacement: str | None = None
    remove_underscore: bool = False
    character_tag_expand: bool = False
    character_tags_first: bool = False
    use_rating_tags: bool = False
    use_rating_tags_as_last_tag: bool = False
    use_quality_tags: bool = False
    use_quality_tags_as_last_tag: bool = False

    def __post_init__(self):
        for name in ("thresh", "general_threshold", "character_threshold", "copyright_threshold",
                     "meta_threshold", "model_threshold", "artist_threshold"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise TaggerError(f"--{name} {v}: not a finite number")
        if self.caption_separator == "":
            raise TaggerError("--caption_separator is empty")
        parse_replacements(self.tag_replacement)  # a malformed one fails before the model loads

    def threshold(self, category: str) -> float:
        own = getattr(self, f"{category.lower()}_threshold", None)
        return self.thresh if own is None else own

    @property
    def undesired(self) -> frozenset[str]:
        return frozenset(split_tags(self.undesired_tags, self.caption_separator))


def expand_character(tag: str, separator: str) -> str:
    """``chara_(series)`` -> ``chara<sep>series``; ``chara_(costume)_(series)`` ->
    ``chara_(costume)<sep>series`` (sd-scripts' --character_tag_expand)."""
    if not tag.endswith(")"):
        return tag
    head, _, series = tag.rpartition("(")
    return head.removesuffix("_") + separator + series.replace(")", "")


def without_underscores(tag: str) -> str:
    """sd-scripts' --remove_underscore: tags of three characters or less (``^_^``) are kept."""
    return tag.replace("_", " ") if len(tag) > 3 else tag


def prepare_labels(labels: Labels, opts: TagOptions) -> Labels:
    """The names as captions will show them: character expansion, then underscores, then each
    replacement in order (sd-scripts' order for selected_tags.csv; used for both layouts)."""
    replacements = parse_replacements(opts.tag_replacement)
    names = []
    for name, cat in zip(labels.names, labels.categories):
        if name is not None:
            if cat == "Character" and opts.character_tag_expand:
                name = expand_character(name, opts.caption_separator)
            if opts.remove_underscore:
                name = without_underscores(name)
            for src, dst in replacements:
                name = dst if name == src else name
        names.append(name)
    return labels.renamed(names)


@dataclass
class Tagged:
    """One image's tags in caption order, what --debug shows, and the tags counted for
    --frequency_tags."""
    tags: list[str]
    rating: str = ""
    character: list[str] = field(default_factory=list)
    general: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    counted: list[str] = field(default_factory=list)

    def debug_lines(self, image_path: str, separator: str) -> list[str]:
        lines = ["", f"{image_path}:", f"\tRating tags: {self.rating}",
                 f"\tCharacter tags: {separator.join(self.character)}",
                 f"\tGeneral tags: {separator.join(self.general)}"]
        if self.other:
            lines.append(f"\tOther tags: {separator.join(self.other)}")
        return lines


def _move_first(tags: list[str], first: list[str]) -> list[str]:
    """Each of ``first`` present moves to the front, in turn (so the last named ends first)."""
    for t in first:
        if t in tags:
            tags.remove(t)
            tags.insert(0, t)
    return tags


def tags_of_csv_layout(prob: np.ndarray, labels: Labels, opts: TagOptions) -> Tagged:
    """SmilingWolf layout: general and character tags over their thresholds in label order
    (with --character_tags_first each character tag is inserted at the front, so they come in
    reverse order), the rating by argmax of the rating labels."""
    out = Tagged(tags=[])
    undesired = opts.undesired
    general_t, character_t = opts.threshold("General"), opts.threshold("Character")
    for i, (name, cat) in enumerate(zip(labels.names, labels.categories)):
        if name is None or name in undesired:
            continue
        if cat == "General" and prob[i] >= general_t:
            out.general.append(name)
            out.tags.append(name)
        elif cat == "Character" and prob[i] >= character_t:
            out.character.append(name)
            out.tags.insert(0, name) if opts.character_tags_first else out.tags.append(name)
        else:
            continue
        out.counted.append(name)
    ratings = [i for i, c in enumerate(labels.categories) if c == "Rating"]
    if (opts.use_rating_tags or opts.use_rating_tags_as_last_tag) and ratings:
        rating = labels.names[ratings[int(np.argmax(prob[ratings]))]]
        if rating is not None and rating not in undesired:
            out.rating = rating
            out.counted.append(rating)
            out.tags.insert(0, rating) if opts.use_rating_tags else out.tags.append(rating)
    out.tags = _move_first(out.tags, split_tags(opts.always_first_tags, opts.caption_separator))
    return out


def tags_of_mapping_layout(prob: np.ndarray, labels: Labels, opts: TagOptions) -> Tagged:
    """tag_mapping layout: tags over their category's threshold sorted by score (character tags
    first with --character_tags_first), copyright / meta / model / artist tags among them, the
    best rating and quality tag among those over the lowest threshold, placed first or last."""
    out = Tagged(tags=[])
    undesired = opts.undesired
    lowest = min(opts.threshold(c) for c in ("General", "Character", "Copyright", "Meta", "Model",
                                              "Artist"))
    lowest = min(lowest, opts.thresh)
    scored: list[tuple] = []
    characters: list[tuple] = []
    best = {"Rating": (-1.0, None), "Quality": (-1.0, None)}
    for i in np.where(prob >= lowest)[0]:
        name, cat, p = labels.names[i], labels.categories[i], prob[i]
        if name is None or name in undesired:
            continue
        if cat in best:
            if p > best[cat][0]:
                best[cat] = (p, name)
            continue
        if p < opts.threshold(cat):
            continue
        out.counted.append(name)
        if cat == "General":
            out.general.append(name)
        elif cat == "Character":
            out.character.append(name)
        else:
            out.other.append(f"{name} ({cat})")
        (characters if cat == "Character" and opts.character_tags_first else scored).append((name, p))
    scored.sort(key=lambda t: t[1], reverse=True)
    characters.sort(key=lambda t: t[1], reverse=True)
    out.tags = [name for name, _ in characters + scored]
    quality, rating = best["Quality"][1], best["Rating"][1]
    if quality is not None and (opts.use_quality_tags or opts.use_quality_tags_as_last_tag):
        out.other.append(quality)
        out.tags.append(quality) if opts.use_quality_tags_as_last_tag else out.tags.insert(0, quality)
    if rating is not None:
        out.rating = rating
        if opts.use_rating_tags_as_last_tag:
            out.tags.append(rating)
        elif opts.use_rating_tags:
            out.tags.insert(0, rating)
    out.tags = _move_first(out.tags, split_tags(opts.always_first_tags, opts.caption_separator))
    return out


def appended(existing: str, tags: list[str], separator: str) -> str:
    """--append_tags: the existing caption's tags, then the new ones it does not have."""
    old = split_tags(existing.replace("\r\n", "\n").strip("\n"), separator)
    return separator.join(old + [t for t in tags if t not in old])
