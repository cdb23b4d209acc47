//! What the machine leaves this process: memory (for `--kv-cache-size auto`) and cores (for a
//! `--threads` check). Linux only, read from /proc and the cgroup files; a file that cannot be
//! read counts as "no limit from it".

use std::path::{Path, PathBuf};

/// Memory this process can still take, and where the figure comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Available {
    pub bytes: u64,
    /// `MemAvailable` or `cgroup memory.max` (the smaller one).
    pub source: &'static str,
}

/// The smaller of the kernel's `MemAvailable` and, for each cgroup from this process's up to the
/// root, its `memory.max` less its `memory.current` (v2; v1's `memory.limit_in_bytes` less
/// `memory.usage_in_bytes`). `None` when not even /proc/meminfo can be read.
pub fn available() -> Option<Available> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let mut best = Available {
        bytes: mem_available(&meminfo)?,
        source: "MemAvailable",
    };
    if let Some(left) = cgroup_left() {
        if left < best.bytes {
            best = Available {
                bytes: left,
                source: "cgroup memory.max",
            };
        }
    }
    Some(best)
}

/// `MemAvailable` of /proc/meminfo's text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|l| {
        let kb = l.strip_prefix("MemAvailable:")?.trim().strip_suffix("kB")?;
        kb.trim().parse::<u64>().ok()?.checked_mul(1024)
    })
}

/// The least room any limited cgroup of this process has left.
fn cgroup_left() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut least: Option<u64> = None;
    let mut note = |left: Option<u64>| {
        if let Some(l) = left {
            least = Some(least.map_or(l, |m| m.min(l)));
        }
    };
    for line in own.lines() {
        // v2: "0::/path"; v1: "N:memory:/path" (or with other controllers beside memory).
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next()?, parts.next()?);
        let (base, max, current) = if controllers.is_empty() {
            (
                PathBuf::from("/sys/fs/cgroup"),
                "memory.max",
                "memory.current",
            )
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                PathBuf::from("/sys/fs/cgroup/memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        let mut dir = base.join(path.trim_start_matches('/'));
        loop {
            note(left_in(&dir, max, current));
            if dir == base || !dir.pop() || !dir.starts_with(&base) {
                break;
            }
        }
    }
    least
}

/// `max - current` of a cgroup directory, when it has a limit ("max" or v1's huge number: none).
fn left_in(dir: &Path, max: &str, current: &str) -> Option<u64> {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let limit = read(max)?.trim().parse::<u64>().ok()?;
    if limit >= 1 << 60 {
        return None;
    }
    let used = read(current)
        .and_then(|c| c.trim().parse::<u64>().ok())
        .unwrap_or(0);
    Some(limit.saturating_sub(used))
}

/// This process's resident memory (`VmRSS` of /proc/self/status), in bytes.
pub fn resident() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| {
        let kb = l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?;
        kb.trim().parse::<u64>().ok()?.checked_mul(1024)
    })
}

/// Cores this process may run on: its CPU affinity (sched_getaffinity) and the cgroup's CPU
/// quota, as the standard library counts them.
pub fn cores() -> Option<usize> {
    std::thread::available_parallelism().ok().map(usize::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_reads_kilobytes_as_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   12345678 kB\n";
        assert_eq!(mem_available(text), Some(12_345_678 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn a_cgroup_without_a_limit_leaves_no_bound() {
        let dir = std::env::temp_dir().join(format!("pa-cgroup-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), "max\n").unwrap();
        std::fs::write(dir.join("memory.current"), "1000\n").unwrap();
        assert_eq!(left_in(&dir, "memory.max", "memory.current"), None);
        std::fs::write(dir.join("memory.max"), "5000\n").unwrap();
        assert_eq!(left_in(&dir, "memory.max", "memory.current"), Some(4000));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn this_machine_reports_memory_and_cores() {
        let a = available().expect("/proc/meminfo is readable on Linux");
        assert!(a.bytes > 0, "{a:?}");
        assert!(resident().expect("VmRSS") > 0);
        assert!(cores().expect("cores") >= 1);
    }
}
