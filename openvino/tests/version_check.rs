//! The OpenVINO version check of `create_extensions` (openvino/src/version.rs), on version
//! strings as OpenVINO reports them. The refusal inside a real OpenVINO process is tested by
//! tests/python/test_extension_module.py.

#[path = "../src/version.rs"]
mod version;

#[test]
fn same_release_with_any_build_suffix_is_accepted() {
    for running in [
        "2026.4.1",
        "2026.4.1-22982-e213a147257-releases/2026/4",
        "2026.4.1+custom",
    ] {
        assert_eq!(version::check(running, "2026.4.1"), Ok(()), "{running}");
    }
}

#[test]
fn another_release_is_refused_naming_both() {
    for running in [
        "2026.4.0-22000-abc-releases/2026/4",
        "2025.4.1-20000-def",
        "2026.4.10",
        "2026.4",
        "",
        "custom_build",
    ] {
        let msg = version::check(running, "2026.4.1").expect_err(running);
        assert!(
            msg.contains("built for OpenVINO 2026.4.1")
                && msg.contains(&format!("runs OpenVINO {running}")),
            "{msg}"
        );
    }
}
