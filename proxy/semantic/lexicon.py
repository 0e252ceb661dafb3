"""Word lists the verifier's guard features use (plain constants, no state).

The word-form map and the opposite pairs are built by :func:`build_lexicon`, once per
verifier, not at import.
"""

from __future__ import annotations

from dataclasses import dataclass


def _words(*chunks: str) -> tuple[str, ...]:
    return tuple("".join(chunks).split())


STOPWORDS = frozenset(
    _words(
        "a an the is are was were be been being am do does did doing have has had having i me ",
        "my we our you your he him his she her it its they them their this that these those ",
        "of in on at by for with about as into through during to from up down out off over ",
        "under again further then once here there all any both each few more most other some ",
        "such own same so than too very can will just should would could may might must shall ",
        "what which who whom whose when where why how and or but if because until while s t ",
        "get got there's it's i'm what's how's",
    )
)
NEGATIONS = frozenset(
    _words(
        "not no never none nobody nothing neither nor without cannot cant dont doesnt didnt ",
        "isnt arent wasnt werent wont wouldnt shouldnt couldnt hasnt havent",
    )
)
WH_WORDS = ("what", "why", "how", "when", "where", "who", "which", "whom", "whose")
# Question words that ask for the same kind of answer share a class: "How do I X?" and
# "What is the best way to X?" are the same question, "Why X?" and "Where X?" are not.
WH_CLASSES = {"what": 0, "which": 0, "how": 0, "why": 1, "where": 2, "when": 3, "who": 4,
              "whom": 4, "whose": 4}  # fmt: skip
# Words that point at something outside the text ("this picture", "the code below"):
# two such questions can read alike and still be about different things.
POINTERS = frozenset(_words("below above following attached pictured image picture photo pic"))
DEMONSTRATIVES = frozenset(_words("this these that those"))
COORDINATORS = frozenset(_words("and or vs versus & between"))
NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        _words(
            "zero one two three four five six seven eight nine ten eleven twelve thirteen ",
            "fourteen fifteen sixteen seventeen eighteen nineteen twenty",
        )
    )
}
NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "hundred": "100"})
NUMBER_WORDS.update({"thousand": "1000", "million": "1000000", "billion": "1000000000"})
OPPOSITES = _words(
    "enable/disable buy/sell increase/decrease add/remove start/stop open/close win/lose ",
    "import/export upload/download encrypt/decrypt connect/disconnect install/uninstall ",
    "lock/unlock push/pull accept/reject allow/deny include/exclude first/last more/less ",
    "most/least maximum/minimum max/min best/worst better/worse high/low higher/lower ",
    "highest/lowest big/small large/small long/short fast/slow cheap/expensive hot/cold ",
    "rich/poor early/late before/after above/below inside/outside true/false love/hate ",
    "positive/negative advantage/disadvantage pro/con gain/lose rise/fall raise/lower ",
    "expand/shrink show/hide join/leave borrow/lend give/take send/receive arrive/depart ",
    "men/women man/woman male/female boy/girl husband/wife father/mother son/daughter ",
    "brother/sister north/south east/west left/right up/down enter/exit import/export ",
    "compress/decompress zip/unzip subscribe/unsubscribe follow/unfollow like/dislike ",
    "agree/disagree legal/illegal safe/unsafe happy/sad easy/hard easy/difficult ",
    "light/dark heavy/light strong/weak young/old new/old ascending/descending ",
    "inhale/exhale mount/unmount attach/detach freeze/unfreeze ban/unban block/unblock ",
    "minimize/maximize overestimate/underestimate underweight/overweight deposit/withdraw ",
    "credit/debit profit/loss success/failure pass/fail asleep/awake wet/dry ",
    "dead/alive start/end begin/end online/offline same/different always/never ",
    "guy/girl everything/nothing",
)
_IRREGULAR = {
    "bought": "buy", "sold": "sell", "won": "win", "lost": "lose", "rose": "rise",
    "risen": "rise", "fell": "fall", "fallen": "fall", "gave": "give", "given": "give",
    "took": "take", "taken": "take", "sent": "send", "lent": "lend",
    "shown": "show", "hid": "hide", "hidden": "hide", "froze": "freeze", "frozen": "freeze",
    "began": "begin", "begun": "begin", "died": "dead",
}  # fmt: skip


def _forms(base: str) -> set[str]:
    forms = {base, base + "s", base + "es", base + "d", base + "ed", base + "ing", base + "er"}
    if base.endswith("e"):
        forms |= {base[:-1] + "ing", base[:-1] + "ed"}
    if base.endswith("y"):
        forms |= {base[:-1] + "ies", base[:-1] + "ied"}
    if len(base) > 2 and base[-1] not in "aeiouwy" and base[-2] in "aeiou":
        forms |= {base + base[-1] + "ing", base + base[-1] + "ed"}
    return forms


@dataclass(frozen=True)
class Lexicon:
    form_to_base: dict[str, str]
    opposite_pairs: frozenset[tuple[str, str]]


def build_lexicon() -> Lexicon:
    """Word-form map and opposite pairs (built once by the verifier)."""
    form_to_base: dict[str, str] = dict(_IRREGULAR)
    pairs: set[tuple[str, str]] = set()
    for item in OPPOSITES:
        left, right = item.split("/")
        pairs |= {(left, right), (right, left)}
        for base in (left, right):
            for form in _forms(base):
                form_to_base.setdefault(form, base)
    return Lexicon(form_to_base, frozenset(pairs))
