//! The check that the running OpenVINO is the release the extension was compiled against.
//! The op class is compiled against one release's headers (class layouts, inline code, the
//! `libopenvino.so.<N>` it links): under another release it may crash inside OpenVINO, so
//! `create_extensions` refuses it with a message naming both versions.

/// `Ok` when `running` (OpenVINO's build number, e.g. `2026.4.1-22982-e213a147257-releases/2026/4`)
/// is release `built` (`major.minor.patch`, from the headers); else the message for the user.
pub fn check(running: &str, built: &str) -> Result<(), String> {
    // The build number's leading `major.minor.patch`; the rest (build id, branch) varies between
    // builds of one release and does not change its ABI.
    let release = running.split(['-', '+', ' ']).next().unwrap_or_default();
    if release == built {
        return Ok(());
    }
    Err(format!(
        "libpaged_attention_openvino.so was built for OpenVINO {built}, but this process runs \
         OpenVINO {running}: build the extension against {release} (set OPENVINO_DIR to that \
         OpenVINO and run `cargo build --release -p paged_attention_openvino`), or run it with \
         OpenVINO {built}"
    ))
}
