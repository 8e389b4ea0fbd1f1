//! [`Words`]: the userspace copy of a word array map (the cell array, the refined-block array)
//! in copy-on-write chunks. Chunks never written share one zeroed chunk, and two copies of
//! the same array (with identity classes, the identity-level tables and the class-level ones
//! hold equal cell and block words) keep one copy of every chunk they agree on
//! ([`Words::share_written_from`]); a write copies only the chunk it touches.

use std::fmt;
use std::ops::{Index, Range};
use std::sync::Arc;

/// A fixed-length array of `u32` words in chunks of a fixed size (a rule set's cell words, a
/// block's words: every range the datapath reads at once lies in one chunk).
#[derive(Clone)]
pub struct Words {
    chunks: Vec<Arc<[u32]>>,
    chunk: usize,
    len: usize,
}

impl Default for Words {
    fn default() -> Self {
        Words::zeroed(0, 1)
    }
}

impl Words {
    /// `len` zero words in chunks of `chunk` words (the last chunk may be shorter).
    pub fn zeroed(len: usize, chunk: usize) -> Words {
        assert!(chunk > 0, "chunks of at least one word");
        let full: Arc<[u32]> = vec![0; chunk.min(len)].into();
        let mut chunks = vec![full; len / chunk];
        if !len.is_multiple_of(chunk) {
            chunks.push(vec![0; len % chunk].into());
        }
        Words { chunks, chunk, len }
    }

    /// Number of words.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is no word.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Word `i`, if the array has it.
    pub fn get(&self, i: usize) -> Option<u32> {
        (i < self.len).then(|| self.chunks[i / self.chunk][i % self.chunk])
    }

    /// Sets word `i` (copying its chunk first if another array shares it).
    pub fn set(&mut self, i: usize, v: u32) {
        assert!(i < self.len, "word {i} of {}", self.len);
        let chunk = &mut self.chunks[i / self.chunk];
        if chunk[i % self.chunk] != v {
            Arc::make_mut(chunk)[i % self.chunk] = v;
        }
    }

    /// The words of `r` if it lies in one chunk (else `None`).
    pub fn get_range(&self, r: Range<usize>) -> Option<&[u32]> {
        if r.start > r.end || r.end > self.len {
            return None;
        }
        if r.is_empty() {
            return Some(&[]);
        }
        let c = r.start / self.chunk;
        if (r.end - 1) / self.chunk != c {
            return None;
        }
        let base = c * self.chunk;
        Some(&self.chunks[c][r.start - base..r.end - base])
    }

    /// The words in order.
    pub fn iter(&self) -> impl Iterator<Item = &u32> + '_ {
        self.chunks.iter().flat_map(|c| c.iter())
    }

    /// Takes `other`'s chunks where they hold the same words as this array's (same length and
    /// chunk size, else nothing), among the chunks of words `written` (the words a batch wrote:
    /// the other chunks are as shared as they were): the two arrays then keep one copy of them.
    pub fn share_written_from(&mut self, other: &Words, written: impl IntoIterator<Item = usize>) {
        if self.len != other.len || self.chunk != other.chunk {
            return;
        }
        for i in written {
            let c = i / self.chunk;
            let (Some(mine), Some(theirs)) = (self.chunks.get(c), other.chunks.get(c)) else {
                continue;
            };
            if !Arc::ptr_eq(mine, theirs) && **mine == **theirs {
                self.chunks[c] = Arc::clone(theirs);
            }
        }
    }

    /// Chunks this array holds that are not shared with `other` (nor with each other): what
    /// keeping it costs beside `other`, in chunks.
    pub fn own_chunks(&self, other: &Words) -> usize {
        let theirs: std::collections::HashSet<*const u32> =
            other.chunks.iter().map(|c| c.as_ptr()).collect();
        let mut seen = std::collections::HashSet::new();
        self.chunks
            .iter()
            .filter(|c| !theirs.contains(&c.as_ptr()) && seen.insert(c.as_ptr()))
            .count()
    }
}

impl Index<usize> for Words {
    type Output = u32;
    fn index(&self, i: usize) -> &u32 {
        assert!(i < self.len, "word {i} of {}", self.len);
        &self.chunks[i / self.chunk][i % self.chunk]
    }
}

/// A range within one chunk (panics otherwise, as an out-of-bounds slice does).
impl Index<Range<usize>> for Words {
    type Output = [u32];
    fn index(&self, r: Range<usize>) -> &[u32] {
        self.get_range(r.clone())
            .unwrap_or_else(|| panic!("words {r:?} are not in one chunk of {}", self.chunk))
    }
}

/// Equal words (however the chunks are shared).
impl PartialEq for Words {
    fn eq(&self, other: &Words) -> bool {
        if self.len != other.len {
            return false;
        }
        if self.chunk == other.chunk {
            return self
                .chunks
                .iter()
                .zip(&other.chunks)
                .all(|(a, b)| Arc::ptr_eq(a, b) || a == b);
        }
        self.iter().eq(other.iter())
    }
}

impl Eq for Words {}

impl fmt::Debug for Words {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nonzero = self.iter().filter(|w| **w != 0).count();
        write!(
            f,
            "Words {{ len: {}, chunk: {}, nonzero: {nonzero} }}",
            self.len, self.chunk
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads and writes agree with a vector; shared chunks are copied on write and shared
    /// again when equal; unwritten chunks share one zeroed chunk.
    #[test]
    fn agrees_with_a_vector_and_shares_chunks() {
        let (len, chunk) = (10 * 7 + 3, 7);
        let mut a = Words::zeroed(len, chunk);
        let mut want = vec![0u32; len];
        assert_eq!(
            a.own_chunks(&Words::default()),
            2,
            "one zeroed chunk and the tail"
        );
        for i in (0..len).step_by(5) {
            a.set(i, i as u32 + 1);
            want[i] = i as u32 + 1;
        }
        assert!(a.iter().copied().eq(want.iter().copied()));
        assert_eq!((0..len).map(|i| a[i]).collect::<Vec<_>>(), want);
        assert_eq!(a.get(len), None);
        assert_eq!(&a[7..14], &want[7..14]);
        assert_eq!(a.get_range(6..8), None, "across two chunks");
        assert_eq!(a.get_range(70..73), Some(&want[70..73]));
        let mut b = a.clone();
        assert_eq!(b.own_chunks(&a), 0);
        b.set(8, 99);
        assert_eq!(b.own_chunks(&a), 1, "only the written chunk copied");
        assert_eq!(a[8], want[8], "the other copy unchanged");
        assert_ne!(a, b);
        b.set(8, want[8]);
        assert_eq!(a, b);
        assert_eq!(b.own_chunks(&a), 1, "equal but not yet shared");
        b.share_written_from(&a, [60]);
        assert_eq!(b.own_chunks(&a), 1, "another chunk written");
        b.share_written_from(&a, [9]);
        assert_eq!(b.own_chunks(&a), 0);
        // Built apart, equal words: shared after share_written_from (of every word).
        let mut c = Words::zeroed(len, chunk);
        for (i, &w) in want.iter().enumerate() {
            c.set(i, w);
        }
        assert_eq!(c, a);
        c.set(0, 5);
        c.share_written_from(&a, 0..len);
        assert_eq!(c.own_chunks(&a), 1, "the chunk that differs stays");
        assert_eq!(c[0], 5);
        let other_chunks = Words::zeroed(len, 3);
        let mut d = c.clone();
        d.share_written_from(&other_chunks, 0..len);
        assert_eq!(d, c, "other chunk sizes: nothing taken");
    }
}
