//! Splitting text around special tokens before BPE.
//!
//! Matches are leftmost, and the longest special wins at one position (Hugging Face's added-token
//! matcher is leftmost-longest too). The set is small (tens of tokens), so a per-token `find` with a
//! remembered next position is fast enough and needs no automaton crate.

/// One segment of text after special-token splitting.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Segment<'t> {
    /// Ordinary text, to be pre-tokenized and merged.
    Text(&'t str),
    /// A special token matched verbatim.
    Special(u32),
}

/// Special tokens to match, longest first.
#[derive(Debug, Default)]
pub(crate) struct SpecialMatcher {
    tokens: Vec<(String, u32)>,
}

impl SpecialMatcher {
    pub(crate) fn new(mut tokens: Vec<(String, u32)>) -> SpecialMatcher {
        tokens.retain(|(text, _)| !text.is_empty());
        tokens.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        SpecialMatcher { tokens }
    }

    /// Split `text`; `allow(id)` says whether a special may match in this call.
    pub(crate) fn split<'t>(&self, text: &'t str, allow: impl Fn(u32) -> bool) -> Vec<Segment<'t>> {
        let active: Vec<&(String, u32)> = self.tokens.iter().filter(|(_, id)| allow(*id)).collect();
        let mut segments = Vec::new();
        if active.is_empty() {
            if !text.is_empty() {
                segments.push(Segment::Text(text));
            }
            return segments;
        }
        // next_pos[i]: where active[i] next occurs at or after the cursor (None: never again).
        let mut next_pos: Vec<Option<usize>> =
            active.iter().map(|(s, _)| text.find(s.as_str())).collect();
        let mut cursor = 0;
        loop {
            // Leftmost match; ties go to the earlier entry, which is the longer token.
            let mut best: Option<(usize, usize)> = None;
            for (i, pos) in next_pos.iter().enumerate() {
                if let Some(p) = *pos {
                    if best.is_none_or(|(bp, _)| p < bp) {
                        best = Some((p, i));
                    }
                }
            }
            let Some((pos, i)) = best else { break };
            if pos > cursor {
                segments.push(Segment::Text(&text[cursor..pos]));
            }
            let (token, id) = active[i];
            segments.push(Segment::Special(*id));
            cursor = pos + token.len();
            for (j, p) in next_pos.iter_mut().enumerate() {
                if p.is_some_and(|p| p < cursor) {
                    *p = text[cursor..]
                        .find(active[j].0.as_str())
                        .map(|q| q + cursor);
                }
            }
        }
        if cursor < text.len() {
            segments.push(Segment::Text(&text[cursor..]));
        }
        segments
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftmost_longest() {
        let m = SpecialMatcher::new(vec![
            ("<a>".into(), 1),
            ("<a><b>".into(), 2),
            ("<b>".into(), 3),
        ]);
        assert_eq!(
            m.split("x<a><b>y<b><a>", |_| true),
            vec![
                Segment::Text("x"),
                Segment::Special(2),
                Segment::Text("y"),
                Segment::Special(3),
                Segment::Special(1)
            ]
        );
        assert_eq!(m.split("x<a>", |id| id != 1), vec![Segment::Text("x<a>")]);
    }
}
