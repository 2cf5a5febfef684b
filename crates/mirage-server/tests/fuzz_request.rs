//! The fuzz target "JSON body to a validated request" never panics: a few
//! thousand mutations of valid request bodies (byte flips, splices, JSON
//! edits) through `mirage_server::fuzz_request`, with the mutation loop of
//! `examples/fuzz_request.rs` (which runs it for millions).

#[path = "../examples/fuzz_request.rs"]
#[allow(dead_code)]
mod driver;

#[test]
fn request_checks_never_panic_on_mutated_bodies() {
    let r = driver::run(20_000, 20_251_206);
    assert_eq!(r.executions, 20_000);
    assert!(
        r.panics.is_empty(),
        "{} inputs panicked, first: {:?}",
        r.panics.len(),
        String::from_utf8_lossy(&r.panics[0])
    );
    // The mutations keep some requests valid (the checks are exercised past
    // the JSON parser), and nothing allocates by what a field claims.
    assert!(r.valid > 200, "only {} valid requests", r.valid);
    assert!(
        r.largest_allocation < 64 << 20,
        "{} bytes",
        r.largest_allocation
    );
    eprintln!(
        "{} executions in {:?}, {} valid, slowest {:?}",
        r.executions, r.elapsed, r.valid, r.slowest
    );
}

#[test]
fn seeds_are_what_the_handlers_accept_or_refuse() {
    // The corpus starts from requests the API tests send: all but the last
    // (unsupported fields) validate.
    let n = driver::SEEDS.len();
    for s in &driver::SEEDS[..n - 1] {
        let ok = mirage_server::api::validate_chat(s.as_bytes(), 1024, 0).is_ok()
            || mirage_server::api::validate_completion(s.as_bytes(), 1024, 0).is_ok()
            || mirage_server::api::validate_embeddings(s.as_bytes(), 8).is_ok();
        assert!(ok, "{s}");
    }
    let e =
        mirage_server::api::validate_chat(driver::SEEDS[n - 1].as_bytes(), 1024, 0).unwrap_err();
    assert_eq!(e.code, Some("unsupported_parameter"));
}
