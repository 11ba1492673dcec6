//! Module-name patterns of quantization configs: compressed-tensors' `re:` entries (Python
//! `re.match`, anchored at the start only), ModelOpt's `fnmatch` wildcards (the whole name) and
//! plain names.
//!
//! A small backtracking matcher over the regex subset such configs use: literals, `.`, classes
//! (`[a-z_]`, `[^0-9]`), escapes (`\.`, `\d`, `\w`, `\s`), groups with `|`, `* + ? {m} {m,} {m,n}`
//! (lazy forms too) and `^ $`. Anything else is refused, so a pattern is never silently misread.
//! Names are short, so backtracking costs nothing that matters.

#[derive(Clone, Debug, PartialEq)]
enum Node {
    Char(char),
    Any,
    Class {
        ranges: Vec<(char, char)>,
        negated: bool,
    },
    Start,
    End,
    /// A group: alternatives, each a sequence.
    Group(Vec<Vec<Node>>),
    Repeat {
        node: Box<Node>,
        min: usize,
        max: Option<usize>,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Pattern(Vec<Node>);

impl Pattern {
    /// A plain name: matches only itself.
    pub fn exact(name: &str) -> Pattern {
        Pattern(name.chars().map(Node::Char).chain([Node::End]).collect())
    }

    /// A Python regex as `re.match` uses it: the match starts at the first character and may end
    /// anywhere (add `$` to pin the end).
    pub fn regex(src: &str) -> Result<Pattern, String> {
        let mut p = Parser { chars: src.chars().collect(), pos: 0 };
        let alternatives = p.alternatives()?;
        if p.pos < p.chars.len() {
            return Err(format!("unbalanced `)` at offset {}", p.pos));
        }
        Ok(Pattern(vec![Node::Group(alternatives)]))
    }

    /// A shell wildcard as `fnmatch` uses it: `*`, `?`, `[seq]`, `[!seq]`, over the whole name.
    pub fn glob(src: &str) -> Pattern {
        let chars: Vec<char> = src.chars().collect();
        let mut nodes = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            match chars[i] {
                '*' => nodes.push(Node::Repeat { node: Box::new(Node::Any), min: 0, max: None }),
                '?' => nodes.push(Node::Any),
                '[' => match glob_class(&chars[i + 1..]) {
                    Some((class, used)) => {
                        nodes.push(class);
                        i += used;
                    }
                    None => nodes.push(Node::Char('[')),
                },
                c => nodes.push(Node::Char(c)),
            }
            i += 1;
        }
        nodes.push(Node::End);
        Pattern(nodes)
    }

    pub fn matches(&self, name: &str) -> bool {
        let s: Vec<char> = name.chars().collect();
        seq(&self.0, &s, 0, &mut |_| true)
    }
}

/// `[...]` after the `[` of a glob: the class and the characters it used (through the `]`).
fn glob_class(rest: &[char]) -> Option<(Node, usize)> {
    let negated = rest.first() == Some(&'!');
    let start = usize::from(negated);
    // As in fnmatch, a `]` right after the opening is a literal member.
    let close = start + 1 + rest.get(start + 1..)?.iter().position(|&c| c == ']')?;
    let body = &rest[start..close];
    let mut ranges = Vec::new();
    let mut i = 0;
    while i < body.len() {
        if i + 2 < body.len() && body[i + 1] == '-' {
            ranges.push((body[i], body[i + 2]));
            i += 3;
        } else {
            ranges.push((body[i], body[i]));
            i += 1;
        }
    }
    Some((Node::Class { ranges, negated }, close + 1))
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        let hit = self.peek() == Some(c);
        self.pos += usize::from(hit);
        hit
    }

    fn alternatives(&mut self) -> Result<Vec<Vec<Node>>, String> {
        let mut alts = vec![self.sequence()?];
        while self.eat('|') {
            alts.push(self.sequence()?);
        }
        Ok(alts)
    }

    fn sequence(&mut self) -> Result<Vec<Node>, String> {
        let mut nodes = Vec::new();
        while let Some(c) = self.peek() {
            if c == '|' || c == ')' {
                break;
            }
            let atom = self.atom()?;
            nodes.push(self.quantified(atom)?);
        }
        Ok(nodes)
    }

    fn atom(&mut self) -> Result<Node, String> {
        let at = self.pos;
        let c = self.peek().ok_or("unexpected end")?;
        self.pos += 1;
        Ok(match c {
            '.' => Node::Any,
            '^' => Node::Start,
            '$' => Node::End,
            '(' => {
                if self.eat('?') && !self.eat(':') {
                    return Err(format!("group syntax `(?` at offset {at} is not supported"));
                }
                let alts = self.alternatives()?;
                if !self.eat(')') {
                    return Err(format!("unclosed `(` at offset {at}"));
                }
                Node::Group(alts)
            }
            '[' => self.class(at)?,
            '\\' => self.escape(at)?,
            '*' | '+' | '?' => return Err(format!("nothing to repeat at offset {at}")),
            c => Node::Char(c),
        })
    }

    /// After a `\`: a class shorthand or an escaped punctuation character.
    fn escape(&mut self, at: usize) -> Result<Node, String> {
        let c = self.peek().ok_or(format!("trailing `\\` at offset {at}"))?;
        self.pos += 1;
        let (ranges, negated) = match c {
            'd' | 'D' => (DIGIT.to_vec(), c == 'D'),
            'w' | 'W' => (WORD.to_vec(), c == 'W'),
            's' | 'S' => (SPACE.to_vec(), c == 'S'),
            c if c.is_ascii_alphanumeric() => return Err(format!("escape `\\{c}` at offset {at} is not supported")),
            c => return Ok(Node::Char(c)),
        };
        Ok(Node::Class { ranges, negated })
    }

    fn class(&mut self, at: usize) -> Result<Node, String> {
        let negated = self.eat('^');
        let mut ranges = Vec::new();
        let mut first = true;
        loop {
            let c = self.peek().ok_or(format!("unclosed `[` at offset {at}"))?;
            self.pos += 1;
            if c == ']' && !first {
                return Ok(Node::Class { ranges, negated });
            }
            first = false;
            let lo = if c == '\\' {
                match self.escape(at)? {
                    Node::Char(e) => e,
                    Node::Class { ranges: r, negated: false } => {
                        ranges.extend(r);
                        continue;
                    }
                    _ => return Err(format!("negated shorthand inside `[` at offset {at} is not supported")),
                }
            } else {
                c
            };
            let hi = if self.peek() == Some('-') && self.chars.get(self.pos + 1).is_some_and(|&n| n != ']') {
                self.pos += 1;
                let h = self.peek().ok_or(format!("unclosed `[` at offset {at}"))?;
                self.pos += 1;
                h
            } else {
                lo
            };
            ranges.push((lo, hi));
        }
    }

    fn quantified(&mut self, atom: Node) -> Result<Node, String> {
        let at = self.pos;
        let Some((min, max)) = self.quantifier() else { return Ok(atom) };
        if matches!(atom, Node::Start | Node::End) {
            return Err(format!("nothing to repeat at offset {at}"));
        }
        if max.is_some_and(|m| m < min) {
            return Err(format!("min repeat greater than max repeat at offset {at}"));
        }
        // Laziness changes which match is found, never whether one exists (the end is free).
        self.eat('?');
        if self.quantifier().is_some() {
            return Err(format!("multiple repeat (or a possessive quantifier) at offset {at}"));
        }
        Ok(Node::Repeat { node: Box::new(atom), min, max })
    }

    /// Consumes a quantifier if one follows: `*`, `+`, `?`, `{m}`, `{m,}`, `{,n}`, `{m,n}`.
    fn quantifier(&mut self) -> Option<(usize, Option<usize>)> {
        let q = match self.peek()? {
            '*' => (0, None),
            '+' => (1, None),
            '?' => (0, Some(1)),
            '{' => return self.braces(),
            _ => return None,
        };
        self.pos += 1;
        Some(q)
    }

    /// A `{...}` quantifier (consumed), or `None` when the `{` is a literal (nothing consumed).
    fn braces(&mut self) -> Option<(usize, Option<usize>)> {
        let close = self.pos + self.chars[self.pos..].iter().position(|&c| c == '}')?;
        let body: String = self.chars[self.pos + 1..close].iter().collect();
        let number = |s: &str| if s.bytes().all(|b| b.is_ascii_digit()) { s.parse::<usize>().ok() } else { None };
        let bounds = match body.split_once(',') {
            None => number(&body).map(|m| (m, Some(m)))?,
            Some((lo, hi)) => {
                (if lo.is_empty() { 0 } else { number(lo)? }, if hi.is_empty() { None } else { Some(number(hi)?) })
            }
        };
        self.pos = close + 1;
        Some(bounds)
    }
}

const DIGIT: [(char, char); 1] = [('0', '9')];
const WORD: [(char, char); 4] = [('a', 'z'), ('A', 'Z'), ('0', '9'), ('_', '_')];
const SPACE: [(char, char); 3] = [(' ', ' '), ('\t', '\r'), ('\u{0b}', '\u{0c}')];

/// Matches `nodes` at `s[i..]`, calling `k` with each end position until it accepts.
fn seq(nodes: &[Node], s: &[char], i: usize, k: &mut dyn FnMut(usize) -> bool) -> bool {
    match nodes.split_first() {
        None => k(i),
        Some((first, rest)) => one(first, s, i, &mut |j| seq(rest, s, j, k)),
    }
}

fn one(node: &Node, s: &[char], i: usize, k: &mut dyn FnMut(usize) -> bool) -> bool {
    match node {
        Node::Char(c) => s.get(i) == Some(c) && k(i + 1),
        Node::Any => i < s.len() && s[i] != '\n' && k(i + 1),
        Node::Class { ranges, negated } => {
            s.get(i).is_some_and(|&c| ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != *negated) && k(i + 1)
        }
        Node::Start => i == 0 && k(i),
        Node::End => i == s.len() && k(i),
        Node::Group(alts) => alts.iter().any(|a| seq(a, s, i, k)),
        Node::Repeat { node, min, max } => repeat(node, *min, *max, 0, s, i, k),
    }
}

/// Greedy: one more repetition first (only if it consumes input once `min` is met, so an
/// empty-matching body cannot loop), then the rest of the pattern.
fn repeat(
    node: &Node,
    min: usize,
    max: Option<usize>,
    count: usize,
    s: &[char],
    i: usize,
    k: &mut dyn FnMut(usize) -> bool,
) -> bool {
    let more = max.is_none_or(|m| count < m)
        && one(node, s, i, &mut |j| (j > i || count < min) && repeat(node, min, max, count + 1, s, j, k));
    more || (count >= min && k(i))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expectations checked against Python 3.11 `re.match` / `fnmatch.fnmatchcase`.
    #[test]
    fn regex_matches_like_python_re_match() {
        let cases: &[(&str, &str, bool)] = &[
            (r".*mlp\.gate$", "model.layers.0.mlp.gate", true),
            (r".*mlp\.gate$", "model.layers.0.mlp.gate_proj", false),
            (r".*mlp\.gate", "model.layers.0.mlp.gate_proj", true),
            (r"model.visual", "model.visual.blocks.0.attn.qkv", true),
            (r"visual", "model.visual.blocks.0", false),
            (r".*self_attn\.[qkvog]_proj$", "model.layers.3.self_attn.g_proj", true),
            (r".*self_attn\.[qkvog]_proj$", "model.layers.3.self_attn.z_proj", false),
            (r".*mlp\.experts\.\d+\.(gate|up|down)_proj$", "model.layers.1.mlp.experts.17.up_proj", true),
            (r".*mlp\.experts\.\d+\.(gate|up|down)_proj$", "model.layers.1.mlp.shared_expert.up_proj", false),
            (r"(?:lm_head|.*embed)", "lm_head", true),
            (r"^model\.layers\.[0-3]\.", "model.layers.2.mlp", true),
            (r"^model\.layers\.[^0-3]\.", "model.layers.2.mlp", false),
            (r"a{2,3}b", "aab", true),
            (r"a{2,3}b", "ab", false),
            (r"a{2}$", "aaa", false),
            (r"x{,2}", "x{,2}", true),
            (r".*?\.w\w*$", "a.weight", true),
            (r"(a|)*b", "aab", true),
            (r"[\d_]+x", "1_2x", true),
            (r"[]a]", "]", true),
            (r"[a-]", "-", true),
            (r"x{,}y", "x{,}y", false),
            (r"ab{1,}c", "abbc", true),
            (r"a{,2}$", "aa", true),
        ];
        for &(pat, name, want) in cases {
            let p = Pattern::regex(pat).unwrap_or_else(|e| panic!("{pat}: {e}"));
            assert_eq!(p.matches(name), want, "re.match({pat:?}, {name:?})");
        }
    }

    #[test]
    fn unsupported_regex_is_an_error() {
        for pat in [r"(?=x)", r"\bx", r"\1", "(a", "a)", "*a", "[ab", "a**", "x\\", "a{3,2}", "a*+", "^*"] {
            assert!(Pattern::regex(pat).is_err(), "{pat} must be refused");
        }
    }

    #[test]
    fn glob_and_exact() {
        let cases: &[(&str, &str, bool)] = &[
            ("*mlp.gate", "model.layers.0.mlp.gate", true),
            ("*mlp.gate", "model.layers.0.mlp.gate_proj", false),
            ("model.layers.0.mlp*", "model.layers.0.mlp.down_proj", true),
            ("model.layers.?.self_attn*", "model.layers.12.self_attn.q_proj", false),
            ("*.[kv]_proj", "model.layers.1.self_attn.v_proj", true),
            ("*.[!kv]_proj", "model.layers.1.self_attn.v_proj", false),
            ("lm_head", "lm_head", true),
            ("lm_head", "model.lm_head", false),
            ("a[b", "a[b", true),
            ("[]]x", "]x", true),
            ("[!]]x", "]x", false),
        ];
        for &(pat, name, want) in cases {
            assert_eq!(Pattern::glob(pat).matches(name), want, "fnmatchcase({name:?}, {pat:?})");
        }
        assert!(Pattern::exact("lm_head").matches("lm_head"));
        assert!(!Pattern::exact("lm_head").matches("lm_head.x"));
    }
}
