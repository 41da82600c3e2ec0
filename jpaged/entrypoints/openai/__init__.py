"""The OpenAI-compatible HTTP server (`jpaged serve`), one module per job: app
(create_app and its routes), serving and answers (the generation routes),
protocol, sampling_fields and messages (the pydantic request models), responses
(the response bodies), errors, guard (admission, limits, the drain), state,
metrics, tokenizer_routes, lora_routes and admin (the RL routes).

Empty on purpose: importing a model module does not load the web stack.
"""
