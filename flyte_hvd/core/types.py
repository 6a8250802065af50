"""Names for the values that no single type describes, so that an annotation says what it
holds. Each is ``Any`` to a type checker; its name and comment are for the reader."""

from __future__ import annotations

from typing import Any, TypeAlias

# A numpy array, tf.Tensor or torch.Tensor: the helpers shared by the frameworks accept each
# framework's own tensor and give back the same kind.
Tensor: TypeAlias = Any

# What a user's function returns (or a rank sends back): any picklable value, passed through.
UserValue: TypeAlias = Any

# A JSON object as ``json.loads`` gives it: field name -> any JSON value.
JSONObject: TypeAlias = dict[str, Any]
