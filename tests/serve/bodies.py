"""Generated request bodies, valid, almost valid and garbage, for the fuzz tests of the ingress."""

from hypothesis import strategies as st

from .conftest import MODEL

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
FIELDS = {
    "model": st.just(MODEL) | JSON,
    "prompt": st.text(max_size=40)
    | st.lists(st.integers(-3, 1200), max_size=40)
    | st.lists(st.text(max_size=8), max_size=3)
    | JSON,
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]) | JSON, "content": st.text(max_size=20) | JSON}
        ),
        max_size=3,
    )
    | JSON,
    "max_tokens": st.integers(-2, 24) | JSON,
    "max_completion_tokens": st.integers(-2, 24) | JSON,
    "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-1, 2) | JSON,
    "n": st.integers(-1, 3) | JSON,
    "seed": st.integers(-(2**70), 2**70) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "ignore_eos": st.booleans() | JSON,
}
BODIES = st.fixed_dictionaries({}, optional=FIELDS) | JSON
