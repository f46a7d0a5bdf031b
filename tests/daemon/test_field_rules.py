"""The served OpenAPI document says which fields the loaded model takes (daemon/field_rules.py, issue 54 item 6):
found by asking the model's own rules, so that what the document leaves out is what the daemon refuses, and what it
keeps the daemon serves, on the server that serves it (step caching with --cache or not), on image-to-image,
video and instruction-edit families alike. tests/daemon/test_openapi.py runs schemathesis against the document.

Broken on purpose once: with `field_rules` returning no rules, the schemathesis test found cache_threshold (and
skip-layer guidance beside an image) called valid and refused."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from diffusiond.daemon.field_rules import NEVER, REQUIRED, WITH_IMAGE, WITHOUT_IMAGE, field_rules


def _document(server) -> dict:
    with urllib.request.urlopen(f"{server.base_url}/openapi.json", timeout=10) as resp:
        return json.loads(resp.read())


def _post(server, body: dict) -> int:
    request = urllib.request.Request(
        f"{server.base_url}/v1/generations", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as error:
        with error:
            return error.code


SMALL = {"prompt": "a red circle", "num_inference_steps": 1, "width": 64, "height": 64, "seed": 1}


def test_step_caching_is_documented_where_the_server_caches(serve, server):
    """cache_threshold: null only on a server without --cache (a threshold is refused there), a number with it (and
    served)."""
    plain, cached = server, serve(cache="teacache")
    assert ("cache_threshold", NEVER) in field_rules(plain.state.engine)
    assert "cache_threshold" not in dict(field_rules(cached.state.engine))
    for server, documented, status in ((plain, False, 400), (cached, True, 200)):
        props = _document(server)["components"]["schemas"]["GenerationRequest"]["properties"]
        assert (props["cache_threshold"].get("type") != "null") is documented, props["cache_threshold"]
        assert _post(server, {**SMALL, "cache_threshold": 0.1}) == status


def test_an_image_to_image_family_ties_its_fields_to_the_image(server):
    """SD3: strength and a mask only beside an image, skip-layer guidance only without one and only on blocks the
    transformer has; no video or audio-video fields, no references."""
    rules = field_rules(server.state.engine)
    found = dict(rules)
    assert found["strength"] == WITH_IMAGE and found["mask"] == WITH_IMAGE
    assert ("skip_guidance_layers", WITHOUT_IMAGE) in rules
    blocks = len(server.state.engine.adapter.pipe.transformer.transformer_blocks)
    assert ("skip_guidance_layers", blocks - 1) in rules
    for name in ("num_frames", "fps", "stg_scale", "reference_images", "guidance_scale_2", "arguments"):
        assert found[name] == NEVER, name
    schema = _document(server)["components"]["schemas"]["GenerationRequest"]
    layers = [o for o in schema["properties"]["skip_guidance_layers"]["anyOf"] if o["type"] == "array"]
    assert layers[0]["items"]["maximum"] == blocks - 1
    present = {"not": {"type": "null"}}
    tie = {"if": {"properties": {"strength": present}, "required": ["strength"]},
           "then": {"properties": {"image": present}, "required": ["image"]}}  # fmt: skip
    assert tie in schema["allOf"]
    assert schema["properties"]["num_frames"]["type"] == "null"
    # As the document says: a layer past the last block, and strength without an image, are refused.
    assert _post(server, {**SMALL, "skip_guidance_layers": [blocks]}) == 400
    assert _post(server, {**SMALL, "skip_guidance_layers": [blocks - 1]}) == 200
    assert _post(server, {**SMALL, "strength": 0.5}) == 400
    # Skip-layer guidance's settings only beside the layers it skips (alone they would change nothing: refused).
    assert ("skip_layer_guidance_scale", "with skip_guidance_layers") in rules
    assert _post(server, {**SMALL, "skip_layer_guidance_scale": 2.0}) == 400
    assert _post(server, {**SMALL, "skip_layer_guidance_scale": 2.0, "skip_guidance_layers": [0]}) == 200
    tie = {"if": {"properties": {"skip_layer_guidance_stop": present}, "required": ["skip_layer_guidance_stop"]},
           "then": {"properties": {"skip_guidance_layers": present}, "required": ["skip_guidance_layers"]}}  # fmt: skip
    assert tie in schema["allOf"]


def test_a_video_family_takes_its_clip_fields(serve, tiny_wan):
    """Wan 2.1 T2V: its clip fields, their counts and sizes within the limits, no reference image, no sound."""
    server = serve(model=tiny_wan, max_pixels=64 * 64)  # tests/daemon/test_videos.py's
    found = dict(field_rules(server.state.engine))
    assert "num_frames" not in found and "fps" not in found
    doc = _document(server)
    props = doc["components"]["schemas"]["GenerationRequest"]["properties"]
    assert props["video_format"].get("type") != "null" and props["audio_format"]["type"] == "null"
    # Clips of the model's form (1 + 4k frames) up to its limit; OpenAI's videos form takes no reference image
    # from a text-to-video model, and the sizes the pixel limit allows (required: the default is beyond it).
    caps, limits = server.state.engine.adapter.capabilities, server.state.engine.limits
    (counts,) = [o["enum"] for o in props["num_frames"]["anyOf"] if o.get("type") == "integer"]
    assert counts == list(range(1, limits.max_frames + 1, caps.frame_step))
    form = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["properties"]["input_reference"] == {"not": {}} and "size" in form["required"]
    assert _post(server, {**SMALL, "num_frames": counts[1]}) == 200
    assert _post(server, {**SMALL, "num_frames": counts[1] + 1}) == 400


def test_an_instruction_edit_family_requires_its_image(serve, tiny_qwenimage_edit_plus):
    """Every request edits an image: the native body requires one, and OpenAI's generations route (no image) is
    left out of the document (the daemon refuses it, naming image)."""
    server = serve(model=tiny_qwenimage_edit_plus)  # tests/daemon/test_edits.py's
    assert ("image", REQUIRED) in field_rules(server.state.engine)
    doc = _document(server)
    assert "image" in doc["components"]["schemas"]["GenerationRequest"]["required"]
    assert "/v1/images/generations" not in doc["paths"] and "/v1/images/edits" in doc["paths"]
    assert _post(server, SMALL) == 400


def test_lora_names_only_the_registered_adapters(server):
    """`lora` in the document: empty or null with no adapter registered (a name would be refused), and only the
    registered names when there are some (the document is built again when they change: daemon/app.py)."""
    from diffusiond.daemon.model_document import served_document

    engine = server.state.engine
    caps, limits = engine.adapter.capabilities, engine.limits
    none = served_document(caps, limits, 2, True, (), ())["components"]["schemas"]["GenerationRequest"]
    assert none["properties"]["lora"]["anyOf"][0] == {"type": "array", "maxItems": 0}
    some = served_document(caps, limits, 2, True, (), ("style", "ink"))
    (listed,) = [o for o in some["components"]["schemas"]["GenerationRequest"]["properties"]["lora"]["anyOf"]
                 if o.get("type") == "array"]  # fmt: skip
    assert listed["items"]["allOf"][1] == {"properties": {"name": {"enum": ["style", "ink"]}}}
    form = some["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["properties"]["lora"]["enum"] == ["[]", '[{"name": "style"}]', '[{"name": "ink"}]']
    assert _post(server, {**SMALL, "lora": [{"name": "unregistered"}]}) == 400


def test_the_generic_path_lists_what_its_call_takes(serve, tiny_sd15):
    """A pipeline served through its own call (SD 1.5): `arguments` keyed by the call's settable parameters (the
    field probe leaves them to the call's signature), its image-to-image and video fields left out."""
    server = serve(model=tiny_sd15)  # tests/daemon/test_generic_http.py's
    caps = server.state.engine.adapter.capabilities
    found = dict(field_rules(server.state.engine))
    assert "arguments" not in found and found["image"] == NEVER and found["num_frames"] == NEVER
    props = _document(server)["components"]["schemas"]["GenerationRequest"]["properties"]
    (keyed,) = [o for o in props["arguments"]["anyOf"] if o.get("type") == "object"]
    assert keyed["propertyNames"] == {"enum": list(caps.fields)} and "eta" in caps.fields
    small = {**SMALL, "num_inference_steps": 2}
    assert _post(server, {**small, "arguments": {"eta": 0.0}}) == 200
    assert _post(server, {**small, "arguments": {"not_a_parameter": 1}}) == 400
