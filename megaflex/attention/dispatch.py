"""What runs where: the inspectable list of attention forms, and what no form serves. No maths, no choice.

The modules choose their forms in plain code, once at build where the build decides
(``plan.plan_core``: the chunked, recurrent and document forms of a core on each device) and per call
where the call does (decoding, documents, padding): ``core.AttentionCore._run``,
``hybrid.LocalMixingCore._run``, ``window.windowed_linear_attention``. Each form is a ``Row`` holding the
imported function it runs; ``ROWS`` gathers them from those modules (``plan.CORE_ROWS``,
``hybrid.LOCAL_MIXING_ROWS`` / ``MODULE_ROWS``, ``window.WINDOW_ROWS``), each with the conditions
(attributes of a ``Request``) under which its module picks it. ``select(Request(...))`` answers which row
a call takes, for the docs and tests; ``recording`` lists the rows that actually ran.

Ops (the ``op`` axis):

* ``softmax``:      exact softmax attention (``softmax.py``).
* ``linear``:       causal linear attention (``AttentionCore``, ``causal_linear_attention``).
* ``local_mixing``: the hybrid's module-level paths (``hybrid.LocalMixingCore``).
* ``window``:       the one-normaliser window's numerator forms (``window/``).
* ``module``:       the attention module a model builds (``hybrid.build_attention``).

``form`` is "causal" or "bidirectional" (an encoder: every query reads every real key). What has no
bidirectional meaning (a state carried in or out, packed documents, the causal q/k/v convolution, the
gated window, the recurrent scan, context parallelism, the decay) is refused by ``REFUSALS`` with a
message naming the setting and the fix: those a module's construction decides when it is built
(``refused_build``), those a model's settings decide before anything is built (``refused_setting``, the
config check), the rest at the call (``refuse_call``).
The pieces the modules import (``Row``, ``Request``, ``REFUSALS``) live in ``forms.py``; this module
re-exports them.
"""

from __future__ import annotations

from dataclasses import fields

from .forms import (
    ATTENTION_BACKENDS, ATTENTION_FORMS, BUILD_FIELDS, OPS, REFUSALS, SETTING_FIELDS, NoAttentionImplementation,
    Refusal, RefusedAttention, Request, Row, check_backend, chunked_backend, recording, refusal_of, refuse_call,
    refused_build, refused_setting,
)
from .hybrid import LOCAL_MIXING_ROWS, MODULE_ROWS
from .plan import CORE_ROWS
from .window import WINDOW_ROWS

__all__ = [
    "ATTENTION_BACKENDS", "ATTENTION_FORMS", "BUILD_FIELDS", "OPS", "REFUSALS", "ROWS", "SETTING_FIELDS",
    "NoAttentionImplementation", "Refusal", "RefusedAttention", "Request", "Row", "check_backend", "chunked_backend",
    "recording", "refusal_of", "refuse_call", "refused_build", "refused_setting", "select",
]

# every form, gathered from the modules that hold and call them
ROWS: tuple[Row, ...] = (*MODULE_ROWS, *CORE_ROWS, *LOCAL_MIXING_ROWS, *WINDOW_ROWS)


def select(request: Request, rows: tuple[Row, ...] = ROWS) -> Row:
    """The first row of ``rows`` that describes ``request``; ``RefusedAttention`` for a refused one. The
    modules do not call this: it answers which row their plain code picks (docs, tests)."""
    refusal = refusal_of(request)
    if refusal is not None:
        raise RefusedAttention(refusal.message)
    for candidate in rows:
        if candidate.applies(request):
            return candidate
    described = ", ".join(f"{f.name}={getattr(request, f.name)!r}" for f in fields(request))
    raise NoAttentionImplementation(f"no attention implementation for Request({described})")
