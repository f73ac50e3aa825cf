//! Templates through the REST API, as the SDK drives a build, and from another team's side:
//! a name is one team's, uploads need the URL's token, builds start once, and what a build
//! made is only its team's.

mod support;

use serde_json::Value;

/// A gzip tar holding one file, as the SDK uploads a COPY step's files.
fn archive(name: &str, text: &str) -> Vec<u8> {
    let mut tar = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(text.len() as u64);
    header.set_mode(0o644);
    header.set_cksum();
    tar.append_data(&mut header, name, text.as_bytes()).unwrap();
    gzip(&tar.into_inner().unwrap())
}

fn gzip(raw: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, raw).unwrap();
    gz.finish().unwrap()
}

/// `GET /templates/{template}/files/{hash}` as team `key`: its status and answer.
async fn file_link(s: &support::Stack, template: &str, hash: &str, key: &str) -> (u16, Value) {
    s.call("GET", &format!("/templates/{template}/files/{hash}"), Some(key), None)
        .await
}

async fn wait_for_build(s: &support::Stack, template: &str, build: &str) -> Value {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut logs = Vec::new();
    loop {
        let path = format!("/templates/{template}/builds/{build}/status?logsOffset={}", logs.len());
        let (status, answer) = s.call("GET", &path, Some("key-a"), None).await;
        assert_eq!(status, 200, "{answer}");
        logs.extend(answer["logEntries"].as_array().unwrap().iter().cloned());
        let state = answer["status"].as_str().unwrap().to_string();
        if state == "ready" || state == "error" {
            let mut answer = answer;
            answer["allLogs"] = Value::Array(logs);
            return answer;
        }
        assert!(tokio::time::Instant::now() < deadline, "build still {state}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_build_is_its_teams_from_name_to_sandbox() {
    let s = support::stack(4096).await;
    let (status, made) = s
        .call(
            "POST",
            "/v3/templates",
            Some("key-a"),
            Some(r#"{"name": "tpl:v1", "cpuCount": 1, "memoryMB": 256}"#),
        )
        .await;
    assert_eq!(status, 202, "{made}");
    let (template, build) = (made["templateID"].as_str().unwrap(), made["buildID"].as_str().unwrap());
    assert_eq!(made["tags"], serde_json::json!(["v1"]));

    // The name is team-a's now.
    let (status, _) = s
        .call("POST", "/v3/templates", Some("key-b"), Some(r#"{"name": "tpl"}"#))
        .await;
    assert_eq!(status, 403);
    assert_eq!(
        s.call("GET", "/templates/aliases/tpl", Some("key-b"), None).await.0,
        403
    );
    assert_eq!(
        s.call("GET", "/templates/aliases/tpl", Some("key-a"), None).await.0,
        200
    );
    assert_eq!(
        s.call("GET", "/templates/aliases/free-name", Some("key-a"), None)
            .await
            .0,
        404
    );

    // Files: the upload URL is the credential, and only for its team.
    let hash = "ab".repeat(32);
    let (status, link) = file_link(&s, template, &hash, "key-a").await;
    assert_eq!((status, link["present"].as_bool()), (201, Some(false)), "{link}");
    let url = link["url"].as_str().unwrap().to_string();
    let http = reqwest::Client::new();
    let put = |url: String, archive: Vec<u8>| {
        let request = http.put(url).body(archive);
        async move { request.send().await.unwrap() }
    };
    let forged = url.replace("token=", "token=0");
    assert_eq!(put(forged, archive("a.txt", "x")).await.status(), 403);
    assert_eq!(put(url.clone(), archive("hello.txt", "hello\n")).await.status(), 201);
    // The same URL again (seen in a log, say), with other files: answered, and dropped (the
    // build below still finds hello.txt).
    assert_eq!(put(url.clone(), archive("a.txt", "replaced")).await.status(), 201);
    // A URL past its time, rightly signed for it, opens nothing; nor does moving its time on.
    let past = common::clock::now_ms() / 1000 - 1;
    let token = e2b_gateway::templates::files::upload_token("key-a", template, &hash, past);
    let expired = format!(
        "{}/templates/{template}/files/{hash}/upload?expires={past}&token={token}",
        s.url()
    );
    let answer = put(expired.clone(), archive("a.txt", "x")).await;
    assert_eq!(answer.status(), 403);
    assert!(answer.text().await.unwrap().contains("expired"));
    let moved = expired.replace(&format!("expires={past}"), &format!("expires={}", past + 7200));
    assert_eq!(put(moved, archive("a.txt", "x")).await.status(), 403);
    let (_, link) = file_link(&s, template, &hash, "key-a").await;
    assert_eq!(link["present"], true);
    let (status, _) = file_link(&s, template, &hash, "key-b").await;
    assert_eq!(status, 404, "another team's template does not exist for it");

    // The build: steps as the SDK sends them.
    let steps = serde_json::json!({
        "fromTemplate": "base",
        "steps": [
            {"type": "COPY", "args": ["hello.txt", "/home/user/app/", "", ""], "filesHash": hash, "force": false},
            {"type": "RUN", "args": ["cat /home/user/app/hello.txt > /home/user/app/copy.txt && echo step-output", ""], "force": false},
            {"type": "ENV", "args": ["GREETING", "hi"], "force": false},
            {"type": "WORKDIR", "args": ["/home/user/app"], "force": false}
        ],
        "startCmd": "sleep 600",
        "readyCmd": "test -f /home/user/app/copy.txt"
    })
    .to_string();
    let start = format!("/v2/templates/{template}/builds/{build}");
    assert_eq!(s.call("POST", &start, Some("key-b"), Some(&steps)).await.0, 404);
    assert_eq!(s.call("POST", &start, Some("key-a"), Some(&steps)).await.0, 202);
    assert_eq!(
        s.call("POST", &start, Some("key-a"), Some(&steps)).await.0,
        409,
        "a build starts once"
    );
    let done = wait_for_build(&s, template, build).await;
    assert_eq!(done["status"], "ready", "{done}");
    let logs = done["allLogs"].to_string();
    assert!(logs.contains("step-output") && logs.contains("RUN cat"), "{logs}");

    // A sandbox of it, by name and tag; not for another team.
    let body = r#"{"templateID": "tpl:v1"}"#;
    let (status, created) = s.call("POST", "/sandboxes", Some("key-a"), Some(body)).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["templateID"], template);
    assert_eq!(s.call("POST", "/sandboxes", Some("key-b"), Some(body)).await.0, 404);
    let (status, tags) = s
        .call("GET", &format!("/templates/{template}/tags"), Some("key-a"), None)
        .await;
    assert_eq!((status, tags[0]["tag"].as_str()), (200, Some("v1")), "{tags}");

    // Made public: another team starts sandboxes from it, and never reads how it was made
    // (a build's logs hold whatever its steps printed).
    let (status, _) = s
        .call(
            "PATCH",
            &format!("/templates/{template}"),
            Some("key-a"),
            Some(r#"{"public": true}"#),
        )
        .await;
    assert_eq!(status, 200);
    let (status, created) = s.call("POST", "/sandboxes", Some("key-b"), Some(body)).await;
    assert_eq!(status, 201, "{created}");
    for path in [
        format!("/templates/{template}/builds/{build}/status"),
        format!("/templates/{template}/builds/{build}/logs"),
    ] {
        let (status, answer) = s.call("GET", &path, Some("key-b"), None).await;
        assert_eq!(status, 404, "{path}: {answer}");
        assert_eq!(s.call("GET", &path, Some("key-a"), None).await.0, 200, "{path}");
    }
    s.stop().await;
}

/// Template names are one namespace for every team: the cluster's own (`base`, the code
/// interpreter's, the `--templates` file's) are no team's to take, even before the cluster
/// has made them. A team holding `code-interpreter-v1`, made public, would have every other
/// team's default code-interpreter create start its image, with their environment.
#[tokio::test]
async fn a_team_cannot_take_the_clusters_template_names() {
    let s = support::stack(4096).await;
    // A namespaced name is its team's: team-a cannot hold team-b's, only its own.
    for (name, status) in [("team-b/app", 403), ("team-a/app", 202), ("team-a/app:v2", 202)] {
        let body = format!(r#"{{"name": "{name}", "cpuCount": 1, "memoryMB": 256}}"#);
        let (got, answer) = s.call("POST", "/v3/templates", Some("key-a"), Some(&body)).await;
        assert_eq!(got, status, "{name}: {answer}");
    }
    for name in ["code-interpreter-v1", "code-interpreter-v1:latest", "base", "base:v2"] {
        let body = format!(r#"{{"name": "{name}", "cpuCount": 1, "memoryMB": 256}}"#);
        let (status, answer) = s.call("POST", "/v3/templates", Some("key-a"), Some(&body)).await;
        assert_eq!(status, 403, "{name}: {answer}");
        assert!(
            answer["message"].as_str().unwrap_or_default().contains("reserved"),
            "{answer}"
        );
    }
    // Nor by naming a snapshot so.
    let (status, created) = s
        .call("POST", "/sandboxes", Some("key-a"), Some(r#"{"templateID": "base"}"#))
        .await;
    assert_eq!(status, 201, "{created}");
    let id = created["sandboxID"].as_str().unwrap();
    let (status, answer) = s
        .call(
            "POST",
            &format!("/sandboxes/{id}/snapshots"),
            Some("key-a"),
            Some(r#"{"name": "code-interpreter-v1"}"#),
        )
        .await;
    assert_eq!(status, 403, "{answer}");
    s.stop().await;
}

/// A gzip tar of symlinks, as a tenant can craft one: each `(name, target)` a link.
fn links(entries: &[(&str, &str)]) -> Vec<u8> {
    let mut tar = tar::Builder::new(Vec::new());
    for (name, target) in entries {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_size(0);
        header.set_mode(0o777);
        tar.append_link(&mut header, name, target).unwrap();
    }
    gzip(&tar.into_inner().unwrap())
}

/// A COPY step's archive is the tenant's: a link in it to a host folder (absolute, or
/// relative out of the unpacked archive) must not let the step's source name the host's
/// files, which the node (as root) would move into the tenant's template. The build fails,
/// and the host's file stays where it was.
#[tokio::test]
async fn a_copy_step_never_reaches_the_host_through_the_archives_links() {
    let s = support::stack(4096).await;
    let victim = std::env::temp_dir().join(format!("copy-victim-{}", std::process::id()));
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("secret.txt"), "the host's").unwrap();
    let depth = "../".repeat(32);
    let relative = format!("{depth}{}", victim.display().to_string().trim_start_matches('/'));
    let hash = "cd".repeat(32);
    for (i, through) in ["abs/secret.txt", "rel/secret.txt", "abs"].iter().enumerate() {
        let body = format!(r#"{{"name": "sneaky-{i}", "cpuCount": 1, "memoryMB": 256}}"#);
        let (status, made) = s.call("POST", "/v3/templates", Some("key-a"), Some(&body)).await;
        assert_eq!(status, 202, "{made}");
        let (template, build) = (made["templateID"].as_str().unwrap(), made["buildID"].as_str().unwrap());
        let (_, link) = file_link(&s, template, &hash, "key-a").await;
        if link["present"] == false {
            let url = link["url"].as_str().unwrap();
            let archive = links(&[("abs", victim.to_str().unwrap()), ("rel", &relative)]);
            let stored = reqwest::Client::new().put(url).body(archive).send().await.unwrap();
            assert_eq!(stored.status(), 201);
        }
        let steps = serde_json::json!({
            "fromTemplate": "base",
            "steps": [{"type": "COPY", "args": [format!("{through}/"), "/home/user/", "", ""], "filesHash": hash, "force": false}],
        })
        .to_string();
        let start = format!("/v2/templates/{template}/builds/{build}");
        assert_eq!(s.call("POST", &start, Some("key-a"), Some(&steps)).await.0, 202);
        let done = wait_for_build(&s, template, build).await;
        if *through == "abs" {
            // The link itself is what is copied: the build may succeed, moving nothing.
            assert!(victim.join("secret.txt").is_file(), "{through}: {done}");
            continue;
        }
        assert_eq!(done["status"], "error", "{through}: {done}");
        assert!(
            victim.join("secret.txt").is_file(),
            "{through}: the host's file was moved into the template"
        );
    }
    std::fs::remove_dir_all(&victim).unwrap();
    s.stop().await;
}
