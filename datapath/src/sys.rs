//! Raw `bpf(2)` calls aya 0.14 does not offer: batched map updates, deletes and lookups. Plus
//! the kernel-reported memory of a map and the bpffs mount check.

use std::{
    ffi::CString,
    io,
    mem::size_of,
    os::fd::{AsRawFd as _, BorrowedFd},
    path::Path,
};

use aya::Pod;

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

fn bpf(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid, fully initialised `bpf_attr` prefix of the size passed; the
    // pointers in it reference live buffers of the sizes the kernel expects (checked by the
    // callers).
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut BatchAttr,
            size_of::<BatchAttr>() as u32,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `BPF_MAP_UPDATE_BATCH`: `keys[i] -> values[i]` in order. On error, returns how many
/// elements were applied.
pub fn update_batch<K: Pod, V: Pod>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Result<(), (usize, io::Error)> {
    assert_eq!(keys.len(), values.len());
    let mut done = 0;
    // The kernel caps nothing, but keep single syscalls reasonably sized.
    for (ks, vs) in keys.chunks(65_536).zip(values.chunks(65_536)) {
        let mut attr = BatchAttr {
            keys: ks.as_ptr() as u64,
            values: vs.as_ptr() as u64,
            count: ks.len() as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        if let Err(e) = bpf(BPF_MAP_UPDATE_BATCH, &mut attr) {
            return Err((done + attr.count as usize, e));
        }
        done += ks.len();
    }
    Ok(())
}

/// `BPF_MAP_DELETE_BATCH` (hash maps). On error, returns how many keys were deleted.
pub fn delete_batch<K: Pod>(fd: BorrowedFd<'_>, keys: &[K]) -> Result<(), (usize, io::Error)> {
    let mut done = 0;
    for ks in keys.chunks(65_536) {
        let mut attr = BatchAttr {
            keys: ks.as_ptr() as u64,
            count: ks.len() as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        if let Err(e) = bpf(BPF_MAP_DELETE_BATCH, &mut attr) {
            return Err((done + attr.count as usize, e));
        }
        done += ks.len();
    }
    Ok(())
}

/// `BPF_MAP_LOOKUP_BATCH` until the end: every (key, value) of a hash or array map.
pub fn lookup_all<K: Pod + Default, V: Pod + Default>(
    fd: BorrowedFd<'_>,
) -> io::Result<Vec<(K, V)>> {
    const CHUNK: usize = 8192;
    let mut out = Vec::new();
    let mut keys = vec![K::default(); CHUNK];
    let mut values = vec![V::default(); CHUNK];
    // The batch cursor is opaque; 8 bytes or the key size, whichever is larger, holds it.
    let token = size_of::<K>().max(8);
    let mut in_batch = vec![0u8; token];
    let mut out_batch = vec![0u8; token];
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { in_batch.as_ptr() as u64 },
            out_batch: out_batch.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        let r = bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let n = attr.count as usize;
        out.extend(keys[..n].iter().copied().zip(values[..n].iter().copied()));
        match r {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(out),
            Err(e) => return Err(e),
        }
        in_batch.copy_from_slice(&out_batch);
        first = false;
    }
}

/// The memory the kernel charges for a map (`memlock` in its fdinfo): for preallocated maps
/// the full capacity, for the others what their elements use.
pub fn map_memlock(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))?;
    info.lines()
        .find_map(|l| l.strip_prefix("memlock:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| io::Error::other("no memlock line in the map's fdinfo"))
}

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Whether `dir` is (on) a BPF filesystem.
pub fn is_bpffs(dir: &Path) -> bool {
    let Ok(c) = CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into the zeroed struct; `c` is a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    r == 0 && st.f_type as i64 == BPF_FS_MAGIC
}

/// Makes sure `dir` is a BPF filesystem, mounting one there if it is not (needs root).
pub fn ensure_bpffs(dir: &Path) -> io::Result<()> {
    if is_bpffs(dir) {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    if is_bpffs(dir) {
        return Ok(());
    }
    let target = CString::new(dir.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    let fstype = c"bpf";
    // SAFETY: valid C strings; no data argument.
    let r = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `BPF_OBJ_GET`: a file descriptor of a pinned object (map, program, link).
pub fn obj_get(path: &Path) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd as _;
    #[repr(C)]
    #[derive(Default)]
    struct ObjAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        _pad: u32,
    }
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    let mut attr = ObjAttr {
        pathname: c.as_ptr() as u64,
        ..ObjAttr::default()
    };
    // SAFETY: a valid BPF_OBJ_GET attribute; `c` outlives the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            7 as libc::c_long,
            &mut attr as *mut ObjAttr,
            size_of::<ObjAttr>() as u32,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new file descriptor that nobody else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(r as i32) })
}

/// The interface index an XDP or tcx bpf_link is attached to (`BPF_OBJ_GET_INFO_BY_FD`,
/// `xdp.ifindex` / `tcx.ifindex`: both first in the same union); 0 when the link is defunct
/// (its interface was deleted).
pub fn xdp_link_ifindex(fd: BorrowedFd<'_>) -> io::Result<u32> {
    use std::os::fd::AsRawFd as _;
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    // struct bpf_link_info: type, id, prog_id, then an 8-byte aligned union whose `xdp` member
    // starts with the ifindex. The kernel fills at most `info_len` bytes.
    let mut info = [0u64; 8];
    let mut attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: size_of_val(&info) as u32,
        info: info.as_mut_ptr() as u64,
    };
    // SAFETY: a valid BPF_OBJ_GET_INFO_BY_FD attribute; `info` outlives the call and is
    // `info_len` bytes long.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            15 as libc::c_long,
            &mut attr as *mut InfoAttr,
            size_of::<InfoAttr>() as u32,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // Offset 16: the union.
    Ok((info[2] & 0xffff_ffff) as u32)
}

/// The HZ to assume when the kernel's cannot be measured (the largest common value: lifetimes
/// come out longer, never shorter, than configured).
pub const FALLBACK_HZ: u64 = 1000;

/// The kernel's `jiffies` now (the XDP program's clock), from `/proc/timer_list` (root only).
pub fn kernel_jiffies() -> Option<u64> {
    read_jiffies()
}

fn read_jiffies() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/timer_list").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("jiffies:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The kernel's HZ (rate of `jiffies`, the XDP program's clock), measured from
/// `/proc/timer_list` (root only) over ~50 ms and rounded to the nearest configurable value
/// (100, 250, 300, 1000). `None` if it cannot be read.
pub fn kernel_hz() -> Option<u64> {
    let t0 = std::time::Instant::now();
    let j0 = read_jiffies()?;
    std::thread::sleep(std::time::Duration::from_millis(50));
    let j1 = read_jiffies()?;
    let rate = (j1.saturating_sub(j0)) as f64 / t0.elapsed().as_secs_f64();
    [100u64, 250, 300, 1000].into_iter().min_by(|a, b| {
        (*a as f64 - rate)
            .abs()
            .total_cmp(&(*b as f64 - rate).abs())
    })
}

/// A shared, writable mapping of a `BPF_F_MMAPABLE` array map of `u64` elements seen as `u32`
/// words (word `i` at byte `4 * i`: two words per element, see `layout::pair_index`): read and
/// written with atomic loads and stores (the program reads them concurrently).
#[derive(Debug)]
pub struct MappedWords {
    ptr: *mut u32,
    words: usize,
    bytes: usize,
}

// SAFETY: the mapping is owned by this value and only accessed through atomic operations.
unsafe impl Send for MappedWords {}
// SAFETY: as above.
unsafe impl Sync for MappedWords {}

/// Bytes per word.
const ELEMENT: usize = 4;

impl MappedWords {
    /// Maps `words` words (`words / 2` elements) of an mmapable array map of `u64`.
    pub fn new(fd: BorrowedFd<'_>, words: usize) -> io::Result<MappedWords> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let bytes = (words * ELEMENT).div_ceil(page) * page;
        // SAFETY: a fresh shared mapping of the map's value area; the kernel checks the size
        // against the map.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(MappedWords {
            ptr: ptr.cast(),
            words,
            bytes,
        })
    }

    fn word(&self, i: usize) -> &std::sync::atomic::AtomicU32 {
        assert!(i < self.words, "word {i} out of {}", self.words);
        // SAFETY: element `i` is inside the mapping (8-byte stride, page-aligned start) and
        // lives as long as `self`; every access to it is atomic.
        unsafe { std::sync::atomic::AtomicU32::from_ptr(self.ptr.add(i * ELEMENT / 4)) }
    }

    /// Reads word `i`.
    pub fn get(&self, i: usize) -> u32 {
        self.word(i).load(std::sync::atomic::Ordering::Acquire)
    }

    /// Writes word `i` (release: everything written before is visible to a reader that sees
    /// this value).
    pub fn set(&self, i: usize, v: u32) {
        self.word(i).store(v, std::sync::atomic::Ordering::Release);
    }

    /// Number of `u32` words.
    pub fn len(&self) -> usize {
        self.words
    }

    /// Whether there is no word.
    pub fn is_empty(&self) -> bool {
        self.words == 0
    }
}

impl Drop for MappedWords {
    fn drop(&mut self) {
        // SAFETY: the mapping created in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.bytes) };
    }
}
