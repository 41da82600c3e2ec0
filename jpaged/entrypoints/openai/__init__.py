"""The OpenAI-compatible HTTP server (`jpaged serve`), one module per job: app
(create_app and its routes), serving and answers (the generation routes),
protocol, sampling_fields, messages and request_fields (the pydantic request
models, a batch line's too, and the field lists), responses
(the response bodies), errors, guard (admission, limits, the drain), state,
metrics, tokenizer_routes, lora_routes and admin (the RL routes).

Empty on purpose: importing a model module does not load the web stack.
"""
