//! The envd proxy from an attacker's side: a sandbox's ID, another team's API key or another
//! sandbox's token open nothing; only the sandbox's own access token (or a file URL signed
//! with it) does, whether the sandbox is named by headers or by its host name. The node
//! behind the gateway refuses the same requests on its own.

mod support;

use envd_wire::access::{file_signature, FileOperation};
use serde_json::Value;
use support::{stack, DOMAIN};

struct Created {
    id: String,
    token: String,
}

async fn create(s: &support::Stack, key: &str, body: &str) -> Created {
    let (status, created) = s.call("POST", "/sandboxes", Some(key), Some(body)).await;
    assert_eq!(status, 201, "{created:?}");
    assert_eq!(created["domain"], DOMAIN);
    Created {
        id: created["sandboxID"].as_str().unwrap().to_string(),
        token: created["envdAccessToken"]
            .as_str()
            .expect("every sandbox gets an envdAccessToken")
            .to_string(),
    }
}

/// A Connect call to `process.Process/List` through the gateway; `how` adds the addressing
/// and credentials under test.
async fn list_processes(
    s: &support::Stack,
    how: impl FnOnce(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
) -> (u16, Value) {
    let request = reqwest::Client::new()
        .post(format!("{}/process.Process/List", s.url()))
        .header("Content-Type", "application/json")
        .body("{}");
    let r = how(request).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_through_the_gateway_needs_the_sandboxs_own_token() {
    let s = stack(4096).await;
    // `secure: false` is what older SDKs could send: the token is issued all the same.
    let a = create(&s, "key-a", r#"{"templateID":"base","secure":false}"#).await;
    let b = create(&s, "key-b", r#"{"templateID":"base"}"#).await;
    assert_ne!(a.token, b.token);
    let (_, detail) = s
        .call("GET", &format!("/sandboxes/{}", a.id), Some("key-a"), None)
        .await;
    assert_eq!(detail["envdAccessToken"], a.token.as_str());

    let attempts: Vec<(&str, Vec<(&str, String)>)> = vec![
        ("no token", vec![]),
        ("empty token", vec![("X-Access-Token", String::new())]),
        ("wrong token", vec![("X-Access-Token", "0".repeat(a.token.len()))]),
        (
            "another team's sandbox token",
            vec![("X-Access-Token", b.token.clone())],
        ),
        ("the owner's API key", vec![("X-API-Key", "key-a".into())]),
        ("another team's API key", vec![("X-API-Key", "key-b".into())]),
        (
            "a token prefix",
            vec![("X-Access-Token", a.token[..a.token.len() - 1].to_string())],
        ),
    ];
    for (what, headers) in &attempts {
        let answer = list_processes(&s, |mut r| {
            r = r.header("E2b-Sandbox-Id", &a.id);
            for (name, value) in headers {
                r = r.header(*name, value);
            }
            r
        })
        .await;
        support::assert_e2b_error(&answer, 401);
        assert!(
            answer.1["message"].as_str().unwrap().contains("Access-Token")
                || answer.1["message"].as_str().unwrap().contains("token"),
            "{what}: {answer:?}"
        );
        // The same by host name.
        let answer = list_processes(&s, |mut r| {
            r = r.header("Host", format!("49983-{}.{DOMAIN}", a.id));
            for (name, value) in headers {
                r = r.header(*name, value);
            }
            r
        })
        .await;
        support::assert_e2b_error(&answer, 401);
    }
    // Files and every other route are closed alike.
    for path in ["/files?path=/etc/passwd", "/envs", "/filesystem.Filesystem/ListDir"] {
        let r = reqwest::Client::new()
            .get(format!("{}{path}", s.url()))
            .header("E2b-Sandbox-Id", &a.id)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 401, "{path}");
    }

    // The right token opens it, by headers and by host name.
    let (status, _) = list_processes(&s, |r| {
        r.header("E2b-Sandbox-Id", &a.id).header("X-Access-Token", &a.token)
    })
    .await;
    assert_eq!(status, 200);
    let (status, _) = list_processes(&s, |r| {
        r.header("Host", format!("49983-{}.{DOMAIN}", a.id))
            .header("X-Access-Token", &a.token)
    })
    .await;
    assert_eq!(status, 200);
    // /health needs nothing (the SDK's is_running).
    let health = reqwest::Client::new()
        .get(format!("{}/health", s.url()))
        .header("E2b-Sandbox-Id", &a.id)
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 204);

    // The node's envd endpoint is mutual TLS for gateways alone: a local user or network
    // peer holding the sandbox's token, in clear or with another role's certificate, gets no
    // further than the handshake.
    let envd = s.node().envd_endpoint();
    let node_id = s.nodes[0].id.clone();
    let in_clear = reqwest::Client::new()
        .post(format!("{envd}/process.Process/List"))
        .header("E2b-Sandbox-Id", &a.id)
        .header("X-Access-Token", &a.token)
        .header("Content-Type", "application/json")
        .body("{}")
        .send()
        .await;
    assert!(in_clear.is_err(), "the node answered in clear: {in_clear:?}");
    let direct = |role: stack::Role, token: Option<&str>| {
        let hop = e2b_gateway::node_http::NodeHttp::new(&s.security(role));
        let mut request = http::Request::post(hop.uri(&node_id, &envd, "/process.Process/List").unwrap())
            .header("E2b-Sandbox-Id", &a.id)
            .header("Content-Type", "application/json");
        if let Some(token) = token {
            request = request.header("X-Access-Token", token);
        }
        let request = request.body(axum::body::Body::from("{}")).unwrap();
        async move { hop.send(request).await.map(|answer| answer.status().as_u16()) }
    };
    for role in [stack::Role::Balance, stack::Role::Operator] {
        let answered = direct(role, Some(&a.token)).await;
        assert!(answered.is_err(), "the node answered {role}: {answered:?}");
    }
    // A gateway gets through, and the node still refuses on its own what lacks the token.
    assert_eq!(direct(stack::Role::Gateway, None).await.unwrap(), 401);
    assert_eq!(direct(stack::Role::Gateway, Some(&a.token)).await.unwrap(), 200);

    // Another port goes to the sandbox's port (nothing listens on 8000: 502 saying so, in
    // E2B's shape); a malformed port is refused.
    let answer = list_processes(&s, |r| {
        r.header("E2b-Sandbox-Id", &a.id).header("E2b-Sandbox-Port", "8000")
    })
    .await;
    support::assert_e2b_error(&answer, 502);
    assert!(answer.1.to_string().contains("port 8000"), "{:?}", answer.1);
    let answer = list_processes(&s, |r| {
        r.header("E2b-Sandbox-Id", &a.id).header("E2b-Sandbox-Port", "http")
    })
    .await;
    support::assert_e2b_error(&answer, 400);
    s.stop().await;
}

/// `download_url`/`upload_url`: a URL with no headers at all, addressed by host name, signed
/// with the token; it opens its own file for its own operation and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_file_urls_work_without_headers() {
    let s = stack(4096).await;
    let a = create(&s, "key-a", r#"{"templateID":"base"}"#).await;
    let host = format!("49983-{}.{DOMAIN}", a.id);
    let url = |path: &str, op, expiration: Option<u64>| {
        let sig = file_signature(path, op, "", &a.token, expiration);
        let mut q = form_urlencoded::Serializer::new(String::new());
        q.append_pair("path", path).append_pair("signature", &sig);
        if let Some(at) = expiration {
            q.append_pair("signature_expiration", &at.to_string());
        }
        format!("{}/files?{}", s.url(), q.finish())
    };
    let http = reqwest::Client::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let upload = http
        .post(url("shared.txt", FileOperation::Write, Some(now + 60)))
        .header("Host", &host)
        .multipart(
            reqwest::multipart::Form::new().part("file", reqwest::multipart::Part::bytes(b"via a link".to_vec())),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(upload.status().as_u16(), 200, "{}", upload.text().await.unwrap());
    let download = http
        .get(url("shared.txt", FileOperation::Read, None))
        .header("Host", &host)
        .send()
        .await
        .unwrap();
    assert_eq!(download.status().as_u16(), 200);
    assert_eq!(download.text().await.unwrap(), "via a link");
    for (method, link) in [
        (reqwest::Method::POST, url("shared.txt", FileOperation::Read, None)),
        (
            reqwest::Method::GET,
            url("other.txt", FileOperation::Read, None).replace("other.txt", "shared.txt"),
        ),
        (
            reqwest::Method::GET,
            url("shared.txt", FileOperation::Read, Some(now - 1)),
        ),
    ] {
        let r = http.request(method, &link).header("Host", &host).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "{link}");
    }
    s.stop().await;
}

/// Someone who reads the ledger (a dump, a backup, its database) learns no token: manifests
/// keep only seals, and a seal presented as a token opens nothing. The team still gets its
/// token from the gateway, the same every time, and it works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_dump_holds_no_usable_token() {
    let s = stack(4096).await;
    let a = create(
        &s,
        "key-a",
        r#"{"templateID":"base","network":{"allowPublicTraffic":false}}"#,
    )
    .await;
    let (_, detail) = s
        .call("GET", &format!("/sandboxes/{}", a.id), Some("key-a"), None)
        .await;
    assert_eq!(
        detail["envdAccessToken"],
        a.token.as_str(),
        "the token is derived the same again"
    );
    let traffic = detail["trafficAccessToken"]
        .as_str()
        .expect("a sandbox without public traffic has a traffic token")
        .to_string();

    // The attacker's dump: every document of every kind the gateway keeps, as raw JSON.
    let mut dump = String::new();
    for kind in [
        "sandbox",
        "idempotency",
        "node",
        "template",
        "template-name",
        "template-build",
    ] {
        let (docs, _) = s.ledger_client.list::<Value>(kind, "").await.unwrap();
        for doc in docs {
            dump.push_str(&doc.value.to_string());
        }
    }
    assert!(dump.contains(&a.id), "the dump holds the manifest");
    for (what, token) in [("envd", &a.token), ("traffic", &traffic)] {
        assert!(
            !dump.contains(token.as_str()),
            "the {what} token is in the ledger in clear"
        );
    }
    let (manifest, _) = s.ledger_client.list::<Value>("sandbox", "").await.unwrap();
    let seal = manifest[0].value["envd_access_token"].as_str().unwrap().to_string();
    assert!(seal.starts_with(envd_wire::sealed::SEAL_PREFIX), "{seal}");

    // What the dump holds opens nothing; the team's token does.
    for presented in [seal.as_str(), &seal[envd_wire::sealed::SEAL_PREFIX.len()..]] {
        let answer = list_processes(&s, |r| {
            r.header("E2b-Sandbox-Id", &a.id).header("X-Access-Token", presented)
        })
        .await;
        support::assert_e2b_error(&answer, 401);
    }
    let (status, _) = list_processes(&s, |r| {
        r.header("E2b-Sandbox-Id", &a.id).header("X-Access-Token", &a.token)
    })
    .await;
    assert_eq!(status, 200);
    s.0.shut_down().await;
}
