//! Module-name patterns of quantization configs: compressed-tensors' `re:` entries (Python
//! `re.match`, anchored at the start only), ModelOpt's `fnmatch` wildcards (the whole name) and
//! plain names. All three become one `regex::Regex`; syntax the regex crate does not support
//! (look-around, back-references) is an error, so a pattern is never silently misread.

use regex::Regex;

#[derive(Clone, Debug)]
pub struct Pattern(Regex);

impl Pattern {
    /// A plain name: matches only itself.
    pub fn exact(name: &str) -> Pattern {
        Pattern(Regex::new(&format!("^{}$", regex::escape(name))).expect("an escaped literal is a valid regex"))
    }

    /// A Python regex as `re.match` uses it: the match starts at the first character and may end
    /// anywhere (add `$` to pin the end).
    pub fn regex(src: &str) -> Result<Pattern, String> {
        Regex::new(&format!("^(?:{src})")).map(Pattern).map_err(|e| e.to_string())
    }

    /// A shell wildcard as `fnmatch` uses it: `*`, `?`, `[seq]`, `[!seq]`, over the whole name.
    pub fn glob(src: &str) -> Pattern {
        let chars: Vec<char> = src.chars().collect();
        let mut re = String::from("^");
        let mut i = 0;
        while i < chars.len() {
            match chars[i] {
                '*' => re.push_str(".*"),
                '?' => re.push('.'),
                '[' => match glob_class(&chars[i + 1..]) {
                    Some((class, used)) => {
                        re.push_str(&class);
                        i += used;
                    }
                    None => re.push_str(r"\["),
                },
                c => re.push_str(&regex::escape(&c.to_string())),
            }
            i += 1;
        }
        re.push('$');
        Pattern(Regex::new(&re).expect("a translated wildcard is a valid regex"))
    }

    /// A `modules_to_not_convert` entry as transformers' `should_convert_module` reads it: a
    /// Python regex matched from the first character up to a module boundary (the name's end or a
    /// `.`), or a literal suffix of the name. (transformers also takes a match that itself ends in
    /// `.`; no config writes one, and such an entry is read by the two rules above.)
    pub fn transformers_skip(src: &str) -> Result<Pattern, String> {
        Regex::new(&format!(r"^(?:(?:{src})(?:\.|$)|.*{}$)", regex::escape(src)))
            .map(Pattern)
            .map_err(|e| e.to_string())
    }

    pub fn matches(&self, name: &str) -> bool {
        self.0.is_match(name)
    }
}

/// A `[...]` wildcard class (after the `[`) as a regex class, with the characters it used; `None`
/// when unterminated (then `[` is literal, as in fnmatch). A `]` right after `[` or `[!` is literal.
fn glob_class(rest: &[char]) -> Option<(String, usize)> {
    let negated = rest.first() == Some(&'!');
    let body_start = usize::from(negated);
    let close = rest.iter().skip(body_start + 1).position(|&c| c == ']')? + body_start + 1;
    let body: String = rest[body_start..close]
        .iter()
        .map(|&c| if matches!(c, '\\' | '[' | ']' | '^' | '&' | '~') { format!("\\{c}") } else { c.to_string() })
        .collect();
    Some((format!("[{}{body}]", if negated { "^" } else { "" }), close + 1))
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
            (r".*?\.w\w*$", "a.weight", true),
            (r"(a|)*b", "aab", true),
            (r"[\d_]+x", "1_2x", true),
            (r"[]a]", "]", true),
            (r"[a-]", "-", true),
            (r"ab{1,}c", "abbc", true),
        ];
        for &(pat, name, want) in cases {
            let p = Pattern::regex(pat).unwrap_or_else(|e| panic!("{pat}: {e}"));
            assert_eq!(p.matches(name), want, "re.match({pat:?}, {name:?})");
        }
    }

    #[test]
    fn unsupported_regex_is_an_error() {
        for pat in [r"(?=x)", r"(?<!x)y", r"\1", "(a", "a)", "*a", "[ab", "x\\", "a{3,2}"] {
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

    /// Expectations checked against transformers 5.24's `should_convert_module`.
    #[test]
    fn transformers_skip_matches_like_should_convert_module() {
        let cases: &[(&str, &str, bool)] = &[
            ("mlp.gate", "model.layers.0.mlp.gate", true),
            ("mlp.gate", "model.layers.0.mlp.gate_proj", false),
            ("model.layers.1", "model.layers.1.mlp.gate", true),
            ("model.layers.1", "model.layers.11.mlp.gate", false),
            (r"model\.layers\.\d+\.mlp\.gate", "model.layers.3.mlp.gate", true),
            (r"model\.layers\.\d+\.mlp\.gate", "model.layers.3.mlp.gate_proj", false),
            ("lm_head", "lm_head", true),
            ("in_proj_a", "model.layers.0.linear_attn.in_proj_a", true),
            ("in_proj_a", "model.layers.0.linear_attn.in_proj_ab", false),
            ("layers.1", "model.layers.1.mlp", false),
            ("model.layers.*.self_attn", "model.layers.12.self_attn.q_proj", true),
            ("shared_expert", "model.layers.0.mlp.shared_expert_gate", false),
        ];
        for &(pat, name, want) in cases {
            let p = Pattern::transformers_skip(pat).unwrap_or_else(|e| panic!("{pat}: {e}"));
            assert_eq!(p.matches(name), want, "should_convert_module({name:?}, [{pat:?}]) == {}", !want);
        }
    }
}
