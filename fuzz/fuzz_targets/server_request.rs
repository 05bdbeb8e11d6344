//! The server's request parsing: a JSON body (any bytes) into a chat or completion request, then validation
//! into generation settings — the path every HTTP request takes before it reaches the model. The first byte
//! picks the endpoint.
#![no_main]
use libfuzzer_sys::fuzz_target;
use server::request::{chat_request, completion_request, parse_body, RequestDefaults};
use server::wire::{ChatCompletionRequest, CompletionRequest};

fuzz_target!(|data: &[u8]| {
    let Some((&first, body)) = data.split_first() else { return };
    let defaults = RequestDefaults { mode: None, vocab_size: 49152, unavailable: Vec::new(), n_layers: 30 };
    if first & 1 == 0 {
        if let Ok(r) = parse_body::<ChatCompletionRequest>(body) {
            let _ = chat_request(r, &defaults);
        }
    } else if let Ok(r) = parse_body::<CompletionRequest>(body) {
        let _ = completion_request(r, &defaults);
    }
});
