//! The crate's module layers hold: `lib.rs` lists the modules layer by layer (a
//! `// Layer` comment line before each group), and no module imports a module of a
//! higher layer or takes part in an import circle. Read from the sources, so a new
//! `use` that breaks the layering fails here rather than in review.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Modules of `lib.rs` in order, with the index of their layer.
fn layers(lib: &str) -> BTreeMap<String, usize> {
    let mut layer = 0usize;
    let mut seen_mod_in_layer = false;
    let mut out = BTreeMap::new();
    for line in lib.lines() {
        let t = line.trim();
        if t.starts_with("//") && !t.starts_with("//!") && !t.starts_with("///") {
            if seen_mod_in_layer {
                layer += 1;
                seen_mod_in_layer = false;
            }
            continue;
        }
        let t = t.strip_prefix("pub ").unwrap_or(t);
        if let Some(name) = t.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
            out.insert(name.to_string(), layer);
            seen_mod_in_layer = true;
        }
    }
    out
}

/// The crate modules `src` imports, outside its unit tests.
fn imports(src: &str, modules: &BTreeMap<String, usize>) -> BTreeSet<String> {
    let code = src.split("#[cfg(test)]\nmod tests").next().unwrap_or(src);
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String =
                    item.trim().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                out.insert(name);
            }
        } else {
            out.insert(rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect());
        }
    }
    out.retain(|m| modules.contains_key(m));
    out
}

#[test]
fn no_module_imports_a_higher_layer_or_closes_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let modules = layers(&lib);
    assert!(modules.len() > 10 && modules.values().max() > Some(&5), "lib.rs lists its layers: {modules:?}");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, &layer) in &modules {
        let text = std::fs::read_to_string(src.join(format!("{m}.rs"))).expect("module source");
        let mut deps = imports(&text, &modules);
        deps.remove(m);
        for d in &deps {
            assert!(
                modules[d] <= layer,
                "{m} (layer {layer}) imports {d} (layer {}): a lower layer never imports an upper one",
                modules[d]
            );
        }
        graph.insert(m.clone(), deps);
    }
    // Within a layer, imports must still form no circle (depth-first search).
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) {
        match state.get(m) {
            Some(2) => return,
            Some(1) => panic!("module circle: {} -> {m}", path.join(" -> ")),
            _ => {}
        }
        state.insert(m.to_string(), 1);
        path.push(m.to_string());
        for d in &graph[m] {
            visit(d, graph, state, path);
        }
        path.pop();
        state.insert(m.to_string(), 2);
    }
    let mut state = BTreeMap::new();
    for m in graph.keys() {
        visit(m, &graph, &mut state, &mut Vec::new());
    }
}

#[test]
fn the_checker_sees_an_upward_import_and_a_circle() {
    let lib = "// Low\nmod a;\nmod b;\n// High\npub mod c;\n";
    let modules = layers(lib);
    assert_eq!(modules["a"], 0);
    assert_eq!(modules["c"], 1);
    let up = imports("use crate::{c, real};\nfn f() { crate::b::g(); }\n", &modules);
    assert_eq!(up, ["b", "c"].iter().map(|s| s.to_string()).collect());
    let tests_only = imports("fn f() {}\n#[cfg(test)]\nmod tests {\n    use crate::c;\n}\n", &modules);
    assert!(tests_only.is_empty(), "unit tests may import anything");
}
